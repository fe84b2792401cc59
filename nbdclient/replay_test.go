package nbdclient

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// request is what a scripted server received: on which connection, and what.
type request struct {
	conn int
	cmd  uint16
	off  uint64
	fill byte // first byte of a write's payload
}

func (q request) String() string {
	if q.cmd == nbdproto.CmdWrite {
		return fmt.Sprintf("%d:write@%d(%c)", q.conn, q.off, q.fill)
	}
	return fmt.Sprintf("%d:%s@%d", q.conn, opName(q.cmd), q.off)
}

// TestReplayOrder drops a connection with a write and a flush in flight and checks what
// the new connection receives, in order: the acknowledged but unflushed write from the
// log, then the write that was in flight (which overlaps it), and only then the flush
// that was in flight and a write made while the server was away.
func TestReplayOrder(t *testing.T) {
	t.Parallel()
	sock := filepath.Join(t.TempDir(), "script.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var mu sync.Mutex
	var got []request
	dropped, release := make(chan struct{}), make(chan struct{})
	serve := func(n int, c net.Conn) {
		defer c.Close()
		if !fakeHandshake(c, nbdproto.TflagHasFlags|nbdproto.TflagSendFlush) {
			return
		}
		for {
			var h [28]byte
			if _, err := io.ReadFull(c, h[:]); err != nil {
				return
			}
			be := binary.BigEndian
			q := request{conn: n, cmd: be.Uint16(h[6:]), off: be.Uint64(h[16:])}
			cookie, length := be.Uint64(h[8:]), be.Uint32(h[24:])
			if q.cmd == nbdproto.CmdDisc {
				return
			}
			if q.cmd == nbdproto.CmdWrite {
				p := make([]byte, length)
				if _, err := io.ReadFull(c, p); err != nil {
					return
				}
				q.fill = p[0]
			}
			mu.Lock()
			got = append(got, q)
			first := len(got) == 1
			mu.Unlock()
			if n == 1 && !first {
				// The first write is acknowledged; the second write and the flush
				// never are: the connection drops once the flush arrives.
				if q.cmd == nbdproto.CmdFlush {
					close(dropped)
					return
				}
				continue
			}
			c.Write(chunk(nbdproto.ReplyFlagDone, nbdproto.ChunkNone, cookie))
		}
	}
	go func() {
		for n := 1; ; n++ {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if n > 1 {
				select {
				case <-release:
				default:
					c.Close() // refused until the test is ready: the client backs off and retries
					continue
				}
			}
			go serve(n, c)
		}
	}()

	r := open(t, "nbd+unix:///?socket="+sock, &Options{BackoffMin: 10 * time.Millisecond, BackoffMax: 20 * time.Millisecond})
	fill := func(b byte) []byte { p := make([]byte, 4096); p[0] = b; return p }
	if _, err := r.WriteAt(fill('A'), 0); err != nil {
		t.Fatal(err)
	}
	results := make(chan error, 3)
	go func() { _, err := r.WriteAt(fill('B'), 0); results <- err }()
	// The flush goes after the write B is on the wire (its order on the connection is
	// the order of sending); wait for the server to have seen B.
	for {
		mu.Lock()
		n := len(got)
		mu.Unlock()
		if n == 2 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	go func() { results <- r.Sync() }()
	<-dropped
	go func() { _, err := r.WriteAt(fill('C'), 8192); results <- err }()
	time.Sleep(50 * time.Millisecond) // let C start waiting for the connection (not asserted)
	close(release)
	for range 3 {
		if err := <-results; err != nil {
			t.Fatal(err)
		}
	}

	mu.Lock()
	defer mu.Unlock()
	var second []request
	for _, q := range got {
		if q.conn > 1 {
			second = append(second, q)
		}
	}
	idx := func(cmd uint16, fill byte) int {
		return slices.IndexFunc(second, func(q request) bool { return q.cmd == cmd && q.fill == fill })
	}
	a, b, c, f := idx(nbdproto.CmdWrite, 'A'), idx(nbdproto.CmdWrite, 'B'), idx(nbdproto.CmdWrite, 'C'), idx(nbdproto.CmdFlush, 0)
	if a < 0 || b < 0 || c < 0 || f < 0 || !(a < b && b < c && b < f) || len(second) != 4 {
		t.Fatalf("after the drop the server received %v; want A's rewrite, then B, then the flush and C", second)
	}
}

package nbd

import (
	"bytes"
	"log/slog"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// lockedBuffer is a log sink that the server's goroutines and the test share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestClosingLineGivesSlowestReply: a connection's closing line says how long its slowest
// request waited for the reply, so that a client's timeout (the kernel's "Connection
// timed out") can be told apart from a server that was slow to answer.
func TestClosingLineGivesSlowestReply(t *testing.T) {
	t.Parallel()
	const hold = 60 * time.Millisecond
	mem := newMem(1 << 20)
	release := blockReadAt0(mem)
	var logs lockedBuffer
	s := oneExportServer(mem, nil)
	s.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	path := serveUnix(t, s)
	rc, _ := mustConnect(t, path, false)
	for h := uint64(1); h <= 3; h++ { // fast ones first: the maximum is kept
		if r := rc.roundTrip(t, nbdproto.CmdRead, 0, h*4096, 4096, nil); r.err != 0 {
			t.Fatalf("read %d: error %d", h, r.err)
		}
	}
	// An idle stretch: a request timed from the connection's start rather than its own
	// arrival would show it.
	time.Sleep(5 * hold)
	start := time.Now()
	rc.send(nbdproto.CmdRead, 0, 9, 0, 4096, nil)
	time.Sleep(hold)
	close(release)
	if r, err := rc.readReply(); err != nil || r.handle != 9 || r.err != 0 {
		t.Fatalf("held read: %+v %v", r, err)
	}
	waited := time.Since(start)
	rc.send(nbdproto.CmdDisc, 0, 10, 0, 0, nil)
	rc.expectClosed(t)

	line := regexp.MustCompile(`msg="nbd: connection closed".*slowest_reply=(\S+)`)
	var m []string
	for deadline := time.Now().Add(10 * time.Second); m == nil && time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		m = line.FindStringSubmatch(logs.String())
	}
	if m == nil {
		t.Fatalf("no closing line with slowest_reply in:\n%s", logs.String())
	}
	got, err := time.ParseDuration(m[1])
	if err != nil {
		t.Fatalf("slowest_reply %q: %v", m[1], err)
	}
	// At least the hold; about what the client waited from sending to reading the reply
	// (the server's clock stops after its write returns, a little after the client may
	// have read the reply), and well short of the idle stretch before the request.
	if got < hold || got > waited+2*hold {
		t.Errorf("slowest_reply %v; want at least the backend's hold %v and about the client's wait %v", got, hold, waited)
	}
}

package nbd

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// holdPool takes the whole shared pool of s, as stalled clients would, until the test
// ends: every request larger than a reserve is then streamed.
func holdPool(t *testing.T, s *Server) {
	t.Helper()
	_, b, _ := sharedPool(s)
	if !s.global.tryAcquire(b) {
		t.Fatal("the shared pool is not free")
	}
	t.Cleanup(func() { s.global.release(b, nil, false) })
}

// TestStreamedRequests: with the shared pool held, a 4 MiB WRITE and READ are served in
// pieces (stream.go) in every reply style: the data round-trips, the backend sees
// streamPiece writes, and FUA becomes a flush after them.
func TestStreamedRequests(t *testing.T) {
	t.Parallel()
	for _, structured := range []bool{false, true} {
		t.Run(fmt.Sprintf("structured=%v", structured), func(t *testing.T) {
			mem := newMem(16 << 20)
			srv := oneExportServer(mem, nil)
			srv.MaxBytes = MaxRequest
			path := serveUnix(t, srv)
			rc, _ := mustConnect(t, path, structured)
			holdPool(t, srv)
			data := pattern(4<<20, 3)
			if r := rc.roundTrip(t, nbdproto.CmdWrite, nbdproto.CmdFlagFUA, 1<<20, 4<<20, data); r.err != 0 {
				t.Fatalf("write: %+v", r)
			}
			r := rc.roundTrip(t, nbdproto.CmdRead, 0, 1<<20, 4<<20, nil)
			if r.err != 0 {
				t.Fatalf("read: error %d %s", r.err, r.msg)
			}
			mustEqual(t, "read", r.data, data)
			ops := mem.opsCopy()
			if len(ops) != 4<<20/streamPiece+1 || ops[len(ops)-1].name != "flush" {
				t.Fatalf("backend saw %+v, want %d writes of %d bytes and a flush", ops, 4<<20/streamPiece, streamPiece)
			}
			for i, o := range ops[:len(ops)-1] {
				if o.name != "write" || o.n != streamPiece || o.off != int64(1<<20+i*streamPiece) || o.flags != 0 {
					t.Fatalf("backend op %d: %+v", i, o)
				}
			}
		})
	}
}

// TestStreamedReadFails: a streamed READ whose backend read fails in its first piece is
// answered with the error; one that fails later ends in an error chunk after the data
// chunk is padded (structured), or in a hard disconnect (simple replies), as proto.md
// requires once a simple reply's header has said success.
func TestStreamedReadFails(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		structured bool
		failAt     int64
	}{{false, 0}, {true, 0}, {false, 2 << 20}, {true, 2 << 20}} {
		t.Run(fmt.Sprintf("structured=%v/at=%d", tc.structured, tc.failAt), func(t *testing.T) {
			mem := newMem(16 << 20)
			mem.hook = func(name string, off, n int64, f Flags) error {
				if name == "read" && off == tc.failAt {
					return &OffsetError{Offset: off + 4096, Err: syscall.EIO}
				}
				return nil
			}
			srv := oneExportServer(mem, nil)
			srv.MaxBytes = MaxRequest
			path := serveUnix(t, srv)
			rc, _ := mustConnect(t, path, tc.structured)
			holdPool(t, srv)
			if err := rc.send(nbdproto.CmdRead, 0, 77, 0, 4<<20, nil); err != nil {
				t.Fatal(err)
			}
			r, err := rc.readReply()
			switch {
			case tc.failAt == 0:
				if err != nil || r.err != nbdproto.EIO || len(r.data) != 0 {
					t.Fatalf("first piece failing: %+v %v, want EIO and no data", r, err)
				}
				if tc.structured && r.errOff != 4096 {
					t.Fatalf("error offset %d, want 4096", r.errOff)
				}
			case !tc.structured:
				if err == nil {
					t.Fatalf("a simple reply that failed part-way was completed: %+v", r)
				}
				rc.expectClosed(t)
			default:
				if err != nil || r.err != nbdproto.EIO || r.errOff != tc.failAt || len(r.data) != 4<<20 {
					t.Fatalf("later piece failing: err %v, reply error %d at %d with %d bytes, want EIO at %d after the whole chunk", err, r.err, r.errOff, len(r.data), tc.failAt)
				}
				mustEqual(t, "data before the failure", r.data[:tc.failAt], make([]byte, tc.failAt))
				if r := rc.roundTrip(t, nbdproto.CmdRead, 0, 8<<20, 4096, nil); r.err != 0 {
					t.Fatalf("the connection did not go on: %+v", r)
				}
			}
		})
	}
}

// TestStreamedRequestsOutlastBackend: a streamed WRITE and READ whose backend holds a
// piece for longer than the I/O timeout (a suspended volume holds requests for as long
// as it is suspended) complete: the payload's and the reply's pace is the client's, and
// the time the backend takes does not count against it. Before, the next piece's
// deadline had passed when the backend returned, and the connection was dropped.
func TestStreamedRequestsOutlastBackend(t *testing.T) {
	t.Parallel()
	for _, structured := range []bool{false, true} {
		t.Run(fmt.Sprintf("structured=%v", structured), func(t *testing.T) {
			t.Parallel()
			// The timeout leaves a loaded machine (and -race) time to move a piece; the hold
			// outlasts it several times.
			const hold = 3 * time.Second
			mem := newMem(16 << 20)
			mem.hook = func(name string, off, n int64, f Flags) error {
				if (name == "write" || name == "read") && off == 1<<20+streamPiece {
					time.Sleep(hold) // the second piece
				}
				return nil
			}
			srv := oneExportServer(mem, nil)
			srv.MaxBytes = MaxRequest
			srv.IOTimeout = time.Second
			srv.minRate = 1 << 40 // no allowance for the size: the timeout alone
			path := serveUnix(t, srv)
			rc, _ := mustConnect(t, path, structured)
			holdPool(t, srv)
			data := pattern(4<<20, 5)
			sent := make(chan error, 1)
			go func() { sent <- rc.send(nbdproto.CmdWrite, 0, 1, 1<<20, 4<<20, data) }()
			r, err := rc.readReply()
			if err != nil || r.err != 0 {
				t.Fatalf("write held by its backend for %v: %+v %v", hold, r, err)
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
			r = rc.roundTrip(t, nbdproto.CmdRead, 0, 1<<20, 4<<20, nil)
			if r.err != 0 {
				t.Fatalf("read held by its backend for %v: error %d %s", hold, r.err, r.msg)
			}
			mustEqual(t, "read", r.data, data)
		})
	}
}

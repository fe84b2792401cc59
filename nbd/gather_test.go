package nbd

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// replyWrites is how many system calls wrote replies, over every connection of s.
func replyWrites(s *Server) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n uint64
	for c := range s.conns {
		c.out.mu.Lock()
		n += c.out.writes
		c.out.mu.Unlock()
	}
	return n
}

// readHandles reads n successful replies and returns the handles they answered.
func readHandles(t *testing.T, rc *rawClient, n int, what string) map[uint64]bool {
	t.Helper()
	got := map[uint64]bool{}
	for range n {
		r, err := rc.readReply()
		if err != nil || r.err != 0 {
			t.Fatalf("%s: reply %+v: %v", what, r, err)
		}
		got[r.handle] = true
	}
	return got
}

// TestRepliesGathered: replies to requests that finish while others of the connection
// run go out together, in one system call once the last of them is done; a client that
// sends one request at a time gets each reply at once.
func TestRepliesGathered(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	// Writes from gated on wait until gate is closed; arrived counts them.
	const gated = 512 << 10
	gate := make(chan struct{})
	var arrived atomic.Int32
	mem.hook = func(name string, off, n int64, f Flags) error {
		if name == "write" && off >= gated {
			arrived.Add(1)
			<-gate
		}
		return nil
	}
	s := oneExportServer(mem, nil)
	s.gatherBound = time.Minute // only the last request's reply writes
	path := serveUnix(t, s)
	rc, _ := mustConnect(t, path, true)

	// One at a time: nothing else runs, so nothing waits (with a minute's bound, a
	// reply that waited would time the client out).
	const alone = 20
	before := replyWrites(s)
	for i := range alone {
		if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, uint64(i)*4096, 4096, pattern(4096, byte(i))); r.err != 0 {
			t.Fatalf("write %d: error %d", i, r.err)
		}
	}
	if got := replyWrites(s) - before; got != alone {
		t.Fatalf("%d replies to requests sent one at a time took %d writes", alone, got)
	}

	// Eight at once, all held in the backend until every one has arrived there.
	const n = 8
	for i := range n {
		if err := rc.send(nbdproto.CmdWrite, 0, uint64(100+i), gated+uint64(i)*4096, 4096, pattern(4096, byte(50+i))); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); arrived.Load() < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d writes reached the backend", arrived.Load(), n)
		}
	}
	before = replyWrites(s)
	close(gate)
	if seen := readHandles(t, rc, n, "released writes"); len(seen) != n {
		t.Fatalf("replies for handles %v, want %d distinct", seen, n)
	}
	if got := replyWrites(s) - before; got != 1 {
		t.Fatalf("%d replies of requests that ran together took %d writes, want 1", n, got)
	}
}

// TestGatherBound: a reply waits for a slow request's at most about the bound, and
// replies to a FUA write and a FLUSH never wait.
func TestGatherBound(t *testing.T) {
	t.Parallel()
	for _, bound := range []time.Duration{20 * time.Millisecond, time.Minute} {
		t.Run(bound.String(), func(t *testing.T) {
			t.Parallel()
			mem := newMem(1 << 20)
			release := blockReadAt0(mem)
			s := oneExportServer(mem, nil)
			s.gatherBound = bound
			path := serveUnix(t, s)
			rc, _ := mustConnect(t, path, true)
			rc.send(nbdproto.CmdRead, 0, 1, 0, 4096, nil) // blocks until release

			// Neither waits for the blocked read, whatever the bound.
			rc.send(nbdproto.CmdWrite, nbdproto.CmdFlagFUA, 2, 4096, 4096, pattern(4096, 2))
			rc.send(nbdproto.CmdFlush, 0, 3, 0, 0, nil)
			got := readHandles(t, rc, 2, "FUA write or flush while a read blocks")
			if !got[2] || !got[3] {
				t.Fatalf("replies %v, want the FUA write's (2) and the flush's (3)", got)
			}

			// A plain write's reply waits for the read, up to the bound.
			start := time.Now()
			rc.send(nbdproto.CmdWrite, 0, 4, 8192, 4096, pattern(4096, 4))
			if bound < time.Second {
				r, err := rc.readReply()
				if err != nil || r.handle != 4 || r.err != 0 {
					t.Fatalf("write while a read blocks: %+v %v", r, err)
				}
				if waited := time.Since(start); waited < bound {
					t.Fatalf("the write's reply came after %v, before the %v bound", waited, bound)
				}
				close(release)
				if r, err := rc.readReply(); err != nil || r.handle != 1 || r.err != 0 {
					t.Fatalf("blocked read: %+v %v", r, err)
				}
				return
			}
			rc.c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			if r, err := rc.readReply(); err == nil {
				t.Fatalf("reply %+v came while the read blocked, under a minute's bound", r)
			}
			rc.c.SetReadDeadline(time.Now().Add(20 * time.Second))
			close(release)
			got = readHandles(t, rc, 2, "after the read's release")
			if !got[1] || !got[4] {
				t.Fatalf("replies %v, want the read's (1) and the write's (4)", got)
			}
		})
	}
}

type failingWriter struct{}

func (failingWriter) Write(p []byte) (int, error) { return 0, errors.New("client gone") }

// TestGatherBoundWriteFails: replies the bound timer writes, and fails to, end the
// connection, as a failed write in a request's goroutine does: no later reply is left
// to notice it.
func TestGatherBoundWriteFails(t *testing.T) {
	t.Parallel()
	aborted := make(chan struct{})
	o := &replyWriter{w: failingWriter{}, boundAfter: time.Millisecond,
		abort: func() { close(aborted) }}
	o.bound = time.AfterFunc(time.Hour, o.checkBound)
	o.bound.Stop()
	o.busy.Add(1) // another request still runs, so this reply waits
	if err := o.send(make([]byte, nbdproto.SimpleReplyHeaderLen), nil, true); err != nil {
		t.Fatalf("a reply that waits: %v", err)
	}
	select {
	case <-aborted:
	case <-time.After(10 * time.Second):
		t.Fatal("the bound timer's failed write did not end the connection")
	}
	if o.failure() == nil {
		t.Fatal("the failed write left no error for later replies")
	}
}

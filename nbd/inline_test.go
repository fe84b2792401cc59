package nbd

import (
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// TestInlineOneAtATime: a client that waits for each reply before it sends again has its
// small reads and writes run by the reader itself, and gets the right answers.
func TestInlineOneAtATime(t *testing.T) {
	t.Parallel()
	mem := newMem(4 << 20)
	s := oneExportServer(mem, nil)
	s.handOnAfter = time.Minute // no hand-on however slow the race detector makes a request
	path := serveUnix(t, s)
	rc, _ := mustConnect(t, path, true)
	const n = 100
	for i := range n {
		if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, uint64(i)*4096, 4096, pattern(4096, byte(i))); r.err != 0 {
			t.Fatalf("write %d: error %d", i, r.err)
		}
	}
	for i := range n {
		r := rc.roundTrip(t, nbdproto.CmdRead, 0, uint64(i)*4096, 4096, nil)
		if r.err != 0 {
			t.Fatalf("read %d: error %d", i, r.err)
		}
		mustEqual(t, "read back", r.data, pattern(4096, byte(i)))
	}
	// A flush and a FUA write run inline too; a large write, a trim and a zeroing do not.
	rc.roundTrip(t, nbdproto.CmdFlush, 0, 0, 0, nil)
	rc.roundTrip(t, nbdproto.CmdWrite, nbdproto.CmdFlagFUA, 0, 4096, pattern(4096, 1))
	if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 0, inlineMax+4096, make([]byte, inlineMax+4096)); r.err != 0 {
		t.Fatalf("large write: error %d", r.err)
	}
	rc.roundTrip(t, nbdproto.CmdTrim, 0, 0, 4096, nil)
	rc.roundTrip(t, nbdproto.CmdWriteZeroes, 0, 0, 4096, nil)
	// All of them: the client sends nothing before the reply, so the reader never finds
	// bytes of another request buffered, nor another request in flight.
	const eligible = 2*n + 2
	if got := inlineCounts(s).inlined; got != eligible {
		t.Fatalf("%d requests ran in the reader; want the %d eligible ones sent one at a time", got, eligible)
	}
	if got := inlineCounts(s).handedOn; got != 0 {
		t.Fatalf("%d hand-ons with a one-minute threshold", got)
	}
}

// TestInlineHandsOn: a request the reader runs itself that blocks does not hold up the
// requests the client sends after it: the reading is handed on, later requests are
// answered first, and the blocked one is answered when it ends, also when the client
// disconnects meanwhile.
func TestInlineHandsOn(t *testing.T) {
	t.Parallel()
	for _, disconnect := range []bool{false, true} {
		name := "continue"
		if disconnect {
			name = "disconnect"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			mem := newMem(1 << 20)
			release := blockReadAt0(mem)
			s := oneExportServer(mem, nil)
			path := serveUnix(t, s)
			rc, _ := mustConnect(t, path, true)
			rc.send(nbdproto.CmdRead, 0, 1, 0, 4096, nil)
			// Long enough for the reader to take the read up and hand the reading on
			// (handOnAfter); if it dispatched the read instead, the rest holds all the same.
			time.Sleep(50 * time.Millisecond)
			if disconnect {
				rc.send(nbdproto.CmdWrite, 0, 2, 4096, 4096, pattern(4096, 2))
				rc.send(nbdproto.CmdDisc, 0, 3, 0, 0, nil)
			} else {
				for h := uint64(2); h < 10; h++ {
					rc.send(nbdproto.CmdRead, 0, h, h*4096, 4096, nil)
					r, err := rc.readReply()
					if err != nil || r.handle != h || r.err != 0 {
						t.Fatalf("read %d while read 1 blocks: %+v %v", h, r, err)
					}
				}
			}
			if disconnect {
				r, err := rc.readReply()
				if err != nil || r.handle != 2 || r.err != 0 {
					t.Fatalf("write sent after the blocked read: %+v %v", r, err)
				}
			}
			if got := inlineCounts(s).handedOn; got != 1 {
				t.Errorf("%d hand-ons, want 1 (the blocked read ran in the reader)", got)
			}
			close(release)
			r, err := rc.readReply()
			if err != nil || r.handle != 1 || r.err != 0 {
				t.Fatalf("blocked read: %+v %v", r, err)
			}
			if disconnect {
				rc.expectClosed(t)
				ops := mem.opsCopy()
				if len(ops) != 2 || ops[1].name != "flush" {
					t.Fatalf("backend saw %+v; want the write, then the flush at disconnect", ops)
				}
				return
			}
			// The new reader serves on: one at a time again.
			for i := range 3 {
				if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 8192, 4096, pattern(4096, byte(i))); r.err != 0 {
					t.Fatalf("write after the hand-on: error %d", r.err)
				}
			}
		})
	}
}

// inlineCounts sums the inline counters of s's open connections.
func inlineCounts(s *Server) (n struct{ inlined, handedOn uint64 }) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		n.inlined += c.inlined.Load()
		n.handedOn += c.handedOn.Load()
	}
	return n
}

// TestHandOnRacesRequestEnd: the inline request that was handed on ends before the
// goroutine that took the reading over has done anything. The connection must count the
// request's goroutine as a worker all the same: before, the taker counted it only after
// its takeover, and the request's end, coming first, took the connection's worker count
// below zero, a panic that ended the whole server.
func TestHandOnRacesRequestEnd(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	release := blockReadAt0(mem)
	s := oneExportServer(mem, nil)
	s.handOnAfter = time.Millisecond
	ended := make(chan struct{})
	s.onTakeOver = func() {
		close(release)
		// The blocked read finishes and its goroutine sees the hand-on, before the
		// taker goes on; its reply is the sign.
		<-ended
	}
	path := serveUnix(t, s)
	rc, _ := mustConnect(t, path, true)
	rc.send(nbdproto.CmdRead, 0, 1, 0, 4096, nil)
	r, err := rc.readReply()
	if err != nil || r.handle != 1 || r.err != 0 {
		t.Fatalf("the read handed on: %+v %v", r, err)
	}
	time.Sleep(20 * time.Millisecond) // the request's goroutine past its end
	close(ended)
	for i := range 3 {
		if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 8192, 4096, pattern(4096, byte(i))); r.err != 0 {
			t.Fatalf("write after the hand-on: error %d", r.err)
		}
	}
	if got := inlineCounts(s).handedOn; got != 1 {
		t.Errorf("%d hand-ons, want 1", got)
	}
	rc.send(nbdproto.CmdDisc, 0, 9, 0, 0, nil)
	rc.expectClosed(t)
}

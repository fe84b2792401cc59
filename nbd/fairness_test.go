package nbd

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// Hostile clients that fill the server's shared budget must not stall anyone else (issue
// 16 item 1): the two reproductions, with raw-protocol attackers and a raw victim.

// waitFor polls cond; the timeout only guards against a hang.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func sharedPool(s *Server) (slots int, bytes int64, queued int) {
	s.global.mu.Lock()
	defer s.global.mu.Unlock()
	return s.global.slots, s.global.bytes, len(s.global.queue)
}

// victimIO runs a 4 KiB WRITE and READ on a fresh connection; the connection's deadline
// (dialRaw's 20 s) is the hang guard.
func victimIO(t *testing.T, path string) {
	t.Helper()
	start := time.Now()
	for _, structured := range []bool{false, true} {
		rc, _ := mustConnect(t, path, structured)
		data := pattern(4096, 42)
		if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 60<<20, 4096, data); r.err != 0 {
			t.Fatalf("victim's write: error %d %s", r.err, r.msg)
		}
		r := rc.roundTrip(t, nbdproto.CmdRead, 0, 60<<20, 4096, nil)
		if r.err != 0 {
			t.Fatalf("victim's read: error %d %s", r.err, r.msg)
		}
		mustEqual(t, "victim's read", r.data, data)
	}
	t.Logf("victim served in %v", time.Since(start).Round(time.Millisecond))
}

// stalledWriters opens n connections that each send a 32 MiB WRITE header and 64 KiB of
// its payload, then stop sending. 64 KiB fits in the socket's buffer, so the attacker's
// write returns at once however slowly the server reads: with 1 MiB it could still be
// blocked when a loaded server's deadline dropped it (a CI run here: broken pipe).
func stalledWriters(t *testing.T, path string, n int) []*rawClient {
	var cs []*rawClient
	for i := range n {
		rc, _ := mustConnect(t, path, i%2 == 0)
		hdr := reqBytes(nbdproto.CmdWrite, 0, 1, 0, 32<<20, nil)
		if err := rc.write(append(hdr, make([]byte, 64<<10)...)); err != nil {
			t.Fatal(err)
		}
		cs = append(cs, rc)
	}
	return cs
}

// unreadReaders opens n connections that each pipeline three 32 MiB READs and never read
// the replies.
func unreadReaders(t *testing.T, path string, n int) []*rawClient {
	var cs []*rawClient
	for i := range n {
		rc, _ := mustConnect(t, path, i%2 == 0)
		for h := range uint64(3) {
			if err := rc.send(nbdproto.CmdRead, 0, h, 0, 32<<20, nil); err != nil {
				t.Fatal(err)
			}
		}
		cs = append(cs, rc)
	}
	return cs
}

// TestStalledWritersDoNotStallOthers: eight connections hold the whole shared pool
// waiting for payloads that never come; another client's 4 KiB WRITE and READ still go
// through at once, from its own reserve, while the pool is still held.
func TestStalledWritersDoNotStallOthers(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(64<<20), nil)
	path := serveUnix(t, srv)
	stalledWriters(t, path, 8)
	waitFor(t, "the stalled writes hold the whole shared pool", func() bool {
		_, b, _ := sharedPool(srv)
		return b == 0
	})
	victimIO(t, path)
	if _, b, _ := sharedPool(srv); b != 0 {
		t.Fatalf("%d shared bytes came back during the victim's I/O: the test did not test a full pool", b)
	}
}

// TestUnreadRepliesDoNotStallOthers: four connections pipeline three 32 MiB READs each
// and never read the replies, filling the shared pool (their third READs wait for their
// connection's budget); another client's WRITE and READ go through.
func TestUnreadRepliesDoNotStallOthers(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(64<<20), nil)
	path := serveUnix(t, srv)
	unreadReaders(t, path, 4)
	waitFor(t, "the unread replies hold the whole shared pool", func() bool {
		_, b, _ := sharedPool(srv)
		return b == 0
	})
	victimIO(t, path)
	if _, b, _ := sharedPool(srv); b != 0 {
		t.Fatalf("%d shared bytes came back during the victim's I/O: the test did not test a full pool", b)
	}
}

// TestIODeadlines: a client that stops sending an announced payload, or stops reading its
// replies, is disconnected after the I/O timeout, and the budget it held comes back, so
// even a request too large for a reserve gets through.
func TestIODeadlines(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		attack func(*testing.T, string, int) []*rawClient
	}{
		{"stalled payload", stalledWriters},
		{"unread replies", unreadReaders},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := oneExportServer(newMem(64<<20), nil)
			// Long enough for an attacker to connect on a loaded machine, short enough
			// to wait for.
			srv.IOTimeout = 2 * time.Second
			srv.minRate = 1 << 40 // the size allowance is negligible
			path := serveUnix(t, srv)
			attackers := tc.attack(t, path, 4)
			waitFor(t, "the server has dropped every attacker", func() bool {
				srv.mu.Lock()
				defer srv.mu.Unlock()
				return len(srv.conns) == 0
			})
			for i, rc := range attackers {
				// The server hangs up: the read ends with EOF or a reset, not our
				// 20 s deadline. (Unread replies may still be buffered: drain them.)
				_, err := io.Copy(io.Discard, rc.c)
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					t.Fatalf("attacker %d still connected", i)
				}
			}
			waitFor(t, "the attackers' budget is back", func() bool {
				s, b, q := sharedPool(srv)
				return s == srv.maxInFlight() && b == srv.maxBytes() && q == 0
			})
			// A request that needs the shared pool is served.
			rc, _ := mustConnect(t, path, true)
			data := pattern(8<<20, 7)
			if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 0, 8<<20, data); r.err != 0 {
				t.Fatalf("8 MiB write after the attack: %+v", r.err)
			}
		})
	}
}

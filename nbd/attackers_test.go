package nbd

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// Attackers for the fairness tests and BenchmarkReadUnderAttack: raw clients that speak
// just enough NBD to hold what the server gives them.

// stallingWriters keeps n raw clients stalled in the middle of a WRITE payload on the
// unix socket at path: each connects, sends a WRITE header announcing size bytes and the
// first 64 KiB of them (which fit the socket's buffer, so the send returns at once), and
// sends nothing more; when the server drops it, it connects and does it again at once.
// stop stops them and waits until they are gone; stalls counts the WRITEs they sent.
func stallingWriters(tb testing.TB, path string, n int, size uint32) (stop func(), stalls *atomic.Int64) {
	tb.Helper()
	stalls = new(atomic.Int64)
	done := make(chan struct{})
	var mu sync.Mutex
	live := make(map[net.Conn]struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := net.Dial("unix", path)
				if err != nil {
					select {
					case <-done:
						return
					case <-time.After(10 * time.Millisecond):
						continue
					}
				}
				mu.Lock()
				select {
				case <-done:
					mu.Unlock()
					c.Close()
					return
				default:
				}
				live[c] = struct{}{}
				mu.Unlock()
				rc := &rawClient{c: c, readLens: map[uint64]uint32{}}
				if _, err := rc.connect("", i%2 == 0); err == nil {
					hdr := reqBytes(nbdproto.CmdWrite, 0, 1, 0, size, nil)
					if rc.write(append(hdr, make([]byte, min(size, 64<<10))...)) == nil {
						stalls.Add(1)
						io.Copy(io.Discard, c) // until the server hangs up, or stop
					}
				}
				mu.Lock()
				delete(live, c)
				mu.Unlock()
				c.Close()
			}
		}()
	}
	return func() {
		mu.Lock()
		close(done)
		for c := range live {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}, stalls
}

// idleTCP opens n TCP connections to addr that read the greeting and send nothing.
func idleTCP(tb testing.TB, addr string, n int) []net.Conn {
	tb.Helper()
	var cs []net.Conn
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { c.Close() })
		var g [18]byte
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadFull(c, g[:]); err != nil {
			tb.Fatalf("idle connection %d: no greeting: %v", len(cs), err)
		}
		cs = append(cs, c)
	}
	return cs
}

// inTransmission counts the server's connections past their handshake.
func inTransmission(s *Server) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for c := range s.conns {
		if c.inTransmission && !c.evicted {
			n++
		}
	}
	return n
}

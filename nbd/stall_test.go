package nbd

import (
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// kernelLikeClient sends requests on one connection as Linux's nbd driver does: simple
// replies, many requests in flight, each written whole (header and payload) by whoever
// submits it, and replies read by one goroutine. It keeps the requests still owed a
// reply, so that a burst can be checked for a reply that never comes.
type kernelLikeClient struct {
	c       net.Conn
	wmu     sync.Mutex
	mu      sync.Mutex
	pending map[uint64]sentReq // by handle
	err     error              // the reading goroutine's end
	answer  chan struct{}      // signalled after every reply
}

type sentReq struct {
	typ    uint16
	length uint32
	at     time.Time
}

func newKernelLikeClient(t *testing.T, path string) *kernelLikeClient {
	rc, _ := mustConnect(t, path, false)
	rc.c.SetDeadline(time.Time{})
	k := &kernelLikeClient{c: rc.c, pending: map[uint64]sentReq{}, answer: make(chan struct{}, 1)}
	go k.readLoop()
	return k
}

func (k *kernelLikeClient) send(typ, flags uint16, handle, off uint64, length uint32, payload []byte) error {
	k.mu.Lock()
	k.pending[handle] = sentReq{typ: typ, length: length, at: time.Now()}
	k.mu.Unlock()
	b := reqBytes(typ, flags, handle, off, length, payload)
	k.wmu.Lock()
	defer k.wmu.Unlock()
	_, err := k.c.Write(b)
	return err
}

func (k *kernelLikeClient) readLoop() {
	var h [16]byte
	var buf []byte
	for {
		if _, err := io.ReadFull(k.c, h[:]); err != nil {
			k.end(err)
			return
		}
		if m := binary.BigEndian.Uint32(h[0:]); m != nbdproto.MagicSimpleReply {
			k.end(fmt.Errorf("bad reply magic %#x", m))
			return
		}
		code, handle := binary.BigEndian.Uint32(h[4:]), binary.BigEndian.Uint64(h[8:])
		k.mu.Lock()
		r, ok := k.pending[handle]
		k.mu.Unlock()
		if !ok {
			k.end(fmt.Errorf("reply to handle %d, which is not in flight", handle))
			return
		}
		if code != 0 {
			k.end(fmt.Errorf("handle %d: error %d", handle, code))
			return
		}
		if r.typ == nbdproto.CmdRead {
			if cap(buf) < int(r.length) {
				buf = make([]byte, r.length)
			}
			if _, err := io.ReadFull(k.c, buf[:r.length]); err != nil {
				k.end(err)
				return
			}
		}
		k.mu.Lock()
		delete(k.pending, handle)
		k.mu.Unlock()
		select {
		case k.answer <- struct{}{}:
		default:
		}
	}
}

func (k *kernelLikeClient) end(err error) {
	k.mu.Lock()
	if k.err == nil {
		k.err = err
	}
	k.mu.Unlock()
	select {
	case k.answer <- struct{}{}:
	default:
	}
}

// waitAll waits until every request sent has its reply, and reports those still
// unanswered once bound has passed.
func (k *kernelLikeClient) waitAll(bound time.Duration) error {
	deadline := time.NewTimer(bound)
	defer deadline.Stop()
	for {
		k.mu.Lock()
		n, err := len(k.pending), k.err
		k.mu.Unlock()
		switch {
		case err != nil:
			return err
		case n == 0:
			return nil
		}
		select {
		case <-k.answer:
		case <-deadline.C:
			k.mu.Lock()
			defer k.mu.Unlock()
			if len(k.pending) == 0 {
				return nil
			}
			var missing []string
			for h, r := range k.pending {
				missing = append(missing, fmt.Sprintf("%d: %s of %d bytes sent %v ago", h, cmdName(r.typ), r.length, time.Since(r.at).Round(time.Millisecond)))
			}
			return fmt.Errorf("%d replies missing %v after the burst's last request: %v", len(missing), bound, missing)
		}
	}
}

// stallDelay is a backend call's delay: mostly none, sometimes a yield, tens of
// microseconds, around a millisecond (past handOnAfter), or a few.
func stallDelay(r *rand.Rand) {
	switch p := r.IntN(100); {
	case p < 40:
	case p < 55:
		runtime.Gosched()
	case p < 80:
		time.Sleep(time.Duration(r.IntN(100)) * time.Microsecond)
	case p < 97:
		time.Sleep(time.Duration(800+r.IntN(400)) * time.Microsecond)
	default:
		time.Sleep(time.Duration(2+r.IntN(4)) * time.Millisecond)
	}
}

// TestNoReplyLeftBehind: under a kernel-like load (several connections, bursts of mixed
// 4 KiB to 128 KiB reads and writes with flushes and FUA writes, a backend whose calls
// take from nothing to a few milliseconds, silence between bursts), every reply of a
// burst arrives once its last request is sent, without the client sending anything more:
// no reply waits, gathered or queued, for a request that never comes. The bound is a hang
// detector: Linux's nbd driver times a request out after 30 s.
func TestNoReplyLeftBehind(t *testing.T) {
	t.Parallel()
	rounds := 40
	if s := os.Getenv("ELI_STALL_ROUNDS"); s != "" {
		rounds, _ = strconv.Atoi(s)
	}
	bound := 10 * time.Second
	if s := os.Getenv("ELI_STALL_BOUND"); s != "" {
		bound, _ = time.ParseDuration(s)
	}
	for _, tc := range []struct {
		name string
		mod  func(*Server)
	}{
		{"defaults", func(*Server) {}},
		// Few requests in flight and a small shared pool: the reader waits for room,
		// and large requests are streamed.
		{"tight", func(s *Server) {
			s.MaxInFlightPerConn = 4
			s.MaxInFlight = 6
			s.MaxBytes = MaxRequest
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const size = 64 << 20
			mem := newMem(size)
			var rmu sync.Mutex
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
			mem.hook = func(string, int64, int64, Flags) error {
				rmu.Lock()
				r := rand.New(rand.NewPCG(rng.Uint64(), 2))
				rmu.Unlock()
				stallDelay(r)
				return nil
			}
			s := oneExportServer(mem, nil)
			tc.mod(s)
			path := serveUnix(t, s)
			const conns = 4
			var wg sync.WaitGroup
			errs := make(chan error, conns)
			for ci := range conns {
				k := newKernelLikeClient(t, path)
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs <- stallClient(k, ci, rounds, bound, size)
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// stallClient sends rounds of bursts on k, each followed by silence once its replies are
// in, and returns the first reply missing bound after its burst's last request.
func stallClient(k *kernelLikeClient, ci, rounds int, bound time.Duration, size int) error {
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(ci)))
	payload := pattern(2<<20, byte(ci))
	handle := uint64(0)
	for round := range rounds {
		burst := 1
		switch p := r.IntN(10); {
		case p < 3: // one at a time, as at queue depth 1
		case p < 7:
			burst = 2 + r.IntN(8)
		default:
			burst = 10 + r.IntN(100)
		}
		var wg sync.WaitGroup
		var serr error
		var smu sync.Mutex
		// Several submitters, as several tasks issue I/O to one hardware queue.
		subs := 1 + r.IntN(3)
		for s := range subs {
			n := burst / subs
			if s == 0 {
				n += burst % subs
			}
			seed := r.Uint64()
			first := handle
			handle += uint64(n)
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(seed, 3))
				for i := range n {
					h := first + uint64(i)
					var typ, flags uint16
					length := uint32(4096 << r.IntN(6)) // 4 KiB to 128 KiB
					if r.IntN(50) == 0 {
						length = 1 << (20 + r.IntN(2)) // 1 or 2 MiB: streamed when the pool is short
					}
					off := uint64(r.IntN(size/4096-int(length)/4096)) * 4096
					switch p := r.IntN(20); {
					case p < 9:
						typ = nbdproto.CmdRead
					case p < 18:
						typ = nbdproto.CmdWrite
						if r.IntN(10) == 0 {
							flags = nbdproto.CmdFlagFUA
						}
					default:
						typ, off, length = nbdproto.CmdFlush, 0, 0
					}
					var p []byte
					if typ == nbdproto.CmdWrite {
						p = payload[:length]
					}
					if err := k.send(typ, flags, h, off, length, p); err != nil {
						smu.Lock()
						serr = err
						smu.Unlock()
						return
					}
					if r.IntN(4) == 0 {
						time.Sleep(time.Duration(r.IntN(1500)) * time.Microsecond)
					}
				}
			}()
		}
		wg.Wait()
		if serr != nil {
			return fmt.Errorf("connection %d round %d: send: %w", ci, round, serr)
		}
		if err := k.waitAll(bound); err != nil {
			return fmt.Errorf("connection %d round %d (burst of %d): %w", ci, round, burst, err)
		}
		// Silence, as between a kernel's bursts.
		time.Sleep(time.Duration(r.IntN(3000)) * time.Microsecond)
	}
	return nil
}

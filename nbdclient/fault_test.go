package nbdclient

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// eventually retries f until it succeeds; the bound is only a hang guard.
func eventually(t *testing.T, what string, f func() error) {
	t.Helper()
	var err error
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if err = f(); err == nil {
			return
		}
	}
	t.Fatalf("%s: still failing: %v", what, err)
}

// TestServerAway stops the server: calls fail with EIO once their time is up, and the
// same Remote serves again, with the data, once the server is back.
func TestServerAway(t *testing.T) {
	t.Parallel()
	s := nbdkit(t, "tcp", nil, "file", image(t, 8<<20))
	var logMu sync.Mutex
	var logged []string
	logf := func(format string, args ...any) {
		logMu.Lock()
		logged = append(logged, fmt.Sprintf(format, args...))
		logMu.Unlock()
	}
	r := open(t, s.uri, &Options{RequestTimeout: 500 * time.Millisecond, BackoffMax: 100 * time.Millisecond, Logf: logf})
	want := bytes.Repeat([]byte("away"), 1024)
	if _, err := r.WriteAt(want, 4096); err != nil {
		t.Fatal(err)
	}
	if err := r.Sync(); err != nil {
		t.Fatal(err)
	}
	s.kill()
	for _, call := range []func() error{
		func() error { _, err := r.ReadAt(make([]byte, 4096), 0); return err },
		func() error { _, err := r.WriteAt(want, 0); return err },
		r.Sync,
	} {
		if err := call(); !errors.Is(err, syscall.EIO) {
			t.Fatalf("with the server gone: %v, want EIO", err)
		}
	}
	s.start()
	got := make([]byte, len(want))
	eventually(t, "read after the server returned", func() error { _, err := r.ReadAt(got, 4096); return err })
	if !bytes.Equal(got, want) {
		t.Fatal("data differs after reconnecting")
	}
	if r.Reconnections() == 0 {
		t.Fatal("no reconnection counted")
	}
	logMu.Lock()
	defer logMu.Unlock()
	if len(logged) < 2 || !strings.Contains(logged[0], "lost the connection") || !strings.Contains(logged[len(logged)-1], "reconnected") {
		t.Fatalf("logged %q", logged)
	}
}

// TestRequestTimeout delays every write beyond the request timeout (nbdkit's delay
// filter): the write fails with EIO, and the Remote goes on serving.
func TestRequestTimeout(t *testing.T) {
	t.Parallel()
	s := nbdkit(t, "unix", nil, "--filter=delay", "memory", "8M", "delay-write=5")
	r := open(t, s.uri, &Options{RequestTimeout: 300 * time.Millisecond})
	if _, err := r.WriteAt(make([]byte, 4096), 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("delayed write: %v, want EIO", err)
	}
	eventually(t, "read after a timed-out write", func() error { _, err := r.ReadAt(make([]byte, 4096), 8192); return err })
}

// sectorData is what version v of sector s holds: its identity, then bytes derived from it,
// so that any wrong or torn sector is recognized.
func sectorData(p []byte, s int, v uint64) {
	binary.LittleEndian.PutUint64(p, uint64(s))
	binary.LittleEndian.PutUint64(p[8:], v)
	rng := rand.New(rand.NewPCG(uint64(s), v))
	for i := 16; i < len(p); i += 8 {
		binary.LittleEndian.PutUint64(p[i:], rng.Uint64())
	}
}

// TestKill9UnderLoad kills the server with SIGKILL and restarts it, again and again,
// while writers and syncs run; then checks every sector: no wrong data, no flushed write
// lost, and (with the replay log) no acknowledged write lost either, even where the
// server's cache lost what it had not flushed.
func TestKill9UnderLoad(t *testing.T) {
	t.Parallel()
	const (
		sectorSize = 4096
		sectors    = 1024
		workers    = 8
		kills      = 4
	)
	fileSrv := func(t *testing.T, img string) *server { return nbdkit(t, "tcp", nil, "file", img) }
	// The cache filter in writeback mode holds writes until a flush, in a cache that
	// dies with the process: acknowledged writes are lost unless replayed.
	volatileSrv := func(t *testing.T, img string) *server {
		return nbdkit(t, "tcp", nil, "--filter=cache", "file", img, "cache=writeback")
	}
	tests := []struct {
		name   string
		srv    func(t *testing.T, img string) *server
		opts   Options
		strict bool // every acknowledged write survives
	}{
		// nbdkit's file plugin and qemu-nbd write to the page cache, which survives them.
		{name: "nbdkit-file", srv: fileSrv, strict: true},
		{name: "qemu-nbd", srv: func(t *testing.T, img string) *server { return qemuNBD(t, "unix", img) }, strict: true},
		{name: "volatile-cache", srv: volatileSrv, strict: true},
		{name: "nbdkit-file-tls", srv: func(t *testing.T, img string) *server {
			serverDir, clientDir := pki(t, t.TempDir())
			s := nbdkit(t, "tcp", []string{"--tls=require", "--tls-certificates=" + serverDir, "--tls-verify-peer"}, "file", img)
			s.uri = strings.Replace(s.uri, "nbd://", "nbds://", 1) + "?tls-certificates=" + clientDir
			return s
		}, strict: true},
		// No replay log: a lost cache must surface as failed Syncs.
		{name: "volatile-cache-no-log", srv: volatileSrv, opts: Options{ReplayLimit: -1}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := tc.srv(t, image(t, sectors*sectorSize))
			o := tc.opts
			o.RequestTimeout, o.BackoffMax = 20*time.Second, 100*time.Millisecond
			r := open(t, srv.uri, &o)

			type sectorState struct {
				acked   uint64   // newest acknowledged version
				maybe   []uint64 // versions whose write failed after acked
				flushed uint64   // newest version a successful Sync covered
			}
			state := make([]sectorState, sectors)
			var stop atomic.Bool
			var durabilityErrs, writes, syncs atomic.Int64
			var wg sync.WaitGroup
			errs := make(chan error, workers)
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 2))
					p := make([]byte, sectorSize)
					for i := 0; !stop.Load(); i++ {
						s := w + workers*rng.IntN(sectors/workers)
						st := &state[s]
						v := max(st.acked, slicesMax(st.maybe)) + 1
						sectorData(p, s, v)
						if _, err := r.WriteAt(p, int64(s)*sectorSize); err != nil {
							if !errors.Is(err, syscall.EIO) {
								errs <- fmt.Errorf("write: %v", err)
								return
							}
							st.maybe = append(st.maybe, v)
						} else {
							st.acked, st.maybe = v, nil
							writes.Add(1)
						}
						if i%16 == 15 {
							snap := make([]uint64, sectors)
							for s := w; s < sectors; s += workers {
								snap[s] = state[s].acked
							}
							err := r.Sync()
							switch {
							case err == nil:
								for s := w; s < sectors; s += workers {
									state[s].flushed = snap[s]
								}
								syncs.Add(1)
							case errors.Is(err, ErrDurability):
								durabilityErrs.Add(1)
							case !errors.Is(err, syscall.EIO):
								errs <- fmt.Errorf("sync: %v", err)
								return
							}
						}
					}
				}()
			}
			for range kills {
				time.Sleep(400 * time.Millisecond)
				before := r.Reconnections()
				srv.kill()
				time.Sleep(150 * time.Millisecond)
				srv.start()
				// The next kill waits for the writers to have reconnected: a kill during
				// a slow reconnection (a TLS handshake on a loaded machine) would fold two
				// kills into one reconnection. A hang guard, not a timing assertion.
				for deadline := time.Now().Add(time.Minute); r.Reconnections() == before; {
					if time.Now().After(deadline) {
						t.Fatalf("no reconnection within a minute of restart %d", before+1)
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			time.Sleep(400 * time.Millisecond)
			stop.Store(true)
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			// One more crash with the writes since each worker's last Sync unflushed and
			// nothing rewriting them after: only a replay can bring them back.
			srv.kill()
			srv.start()
			// A read always goes to the server, so it reconnects; a Sync may answer
			// ErrDurability from what an earlier restart lost without asking the server.
			if _, err := r.ReadAt(make([]byte, sectorSize), 0); err != nil {
				t.Fatalf("read after the final restart: %v", err)
			}
			if err := r.Sync(); err != nil && !errors.Is(err, ErrDurability) {
				t.Fatalf("final sync: %v", err)
			}
			t.Logf("%d writes, %d syncs, %d reconnections, %d syncs failed with ErrDurability",
				writes.Load(), syncs.Load(), r.Reconnections(), durabilityErrs.Load())
			if r.Reconnections() < kills+1 {
				t.Fatalf("%d reconnections for %d kills", r.Reconnections(), kills)
			}
			if tc.opts.ReplayLimit < 0 && durabilityErrs.Load() == 0 {
				t.Error("without a replay log, no Sync reported that a restart lost unflushed writes")
			}

			// Read every sector back through a fresh connection.
			check := open(t, srv.uri, nil)
			got := make([]byte, sectors*sectorSize)
			if _, err := check.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			want := make([]byte, sectorSize)
			var wrong, lostFlushed, lostAcked int
			for s := range sectors {
				g := got[s*sectorSize : (s+1)*sectorSize]
				st := state[s]
				var v uint64
				if !bytes.Equal(g, make([]byte, sectorSize)) {
					v = binary.LittleEndian.Uint64(g[8:])
					sectorData(want, s, v)
					if !bytes.Equal(g, want) || v == 0 {
						wrong++
						continue
					}
				}
				known := v <= st.acked
				for _, m := range st.maybe {
					known = known || v == m
				}
				if !known {
					wrong++ // a version never written
				}
				if v < st.flushed {
					lostFlushed++
				}
				if tc.strict && v < st.acked {
					lostAcked++
				}
			}
			if wrong != 0 || lostFlushed != 0 || lostAcked != 0 {
				t.Fatalf("%d sectors with wrong data, %d lost flushed writes, %d lost acknowledged writes", wrong, lostFlushed, lostAcked)
			}
		})
	}
}

func slicesMax(v []uint64) uint64 {
	var m uint64
	for _, x := range v {
		m = max(m, x)
	}
	return m
}

// TestCloseWhileAway closes a Remote whose server is gone, with a call waiting for it:
// both return, long before the call's own timeout.
func TestCloseWhileAway(t *testing.T) {
	t.Parallel()
	s := nbdkit(t, "unix", nil, "memory", "1M")
	r, err := Open(s.uri, &Options{RequestTimeout: time.Hour, BackoffMin: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	s.kill()
	res := make(chan error, 1)
	go func() { _, err := r.ReadAt(make([]byte, 4096), 0); res <- err }()
	time.Sleep(100 * time.Millisecond) // let the read start waiting (a guard, not an assertion)
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	for _, ch := range []<-chan struct{}{closed, errDone(res, t)} {
		select {
		case <-ch:
		case <-time.After(30 * time.Second):
			t.Fatal("Close or the waiting call hung")
		}
	}
}

// errDone turns the call's result into a channel closed once it returned an error.
func errDone(res <-chan error, t *testing.T) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		if err := <-res; err == nil {
			t.Error("a read with the server gone succeeded")
		}
		close(done)
	}()
	return done
}

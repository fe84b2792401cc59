package volume

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// liveStatus asks the server of name for its status over the control socket.
func liveStatus(t *testing.T, sd StateDir, name string) Status {
	t.Helper()
	var st Status
	if err := control.Call(context.Background(), sd.ControlSocket(name), OpStatus, nil, nil, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestRunSuspendResume: through the control socket, a served volume is suspended (its
// status says so and since when), requests NBD clients send meanwhile are held, a resume
// with a wrong key is refused and changes nothing, and the resume with the volume's key
// answers every held request correctly; a server stopped while suspended fails what it
// holds and loses nothing written before the suspend.
func TestRunSuspendResume(t *testing.T) {
	t.Parallel()
	for _, mode := range []sector.Mode{sector.Default, sector.ModeAESXTS256} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			path, _, mk := testVolume(t, t.TempDir(), 8<<20, mode)
			defer mk.Wipe()
			p, err := provider.Open(path, false)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			sd := StateDir{Path: shortDir(t)}
			name := "s"
			lock, err := sd.LockName(name)
			if err != nil {
				t.Fatal(err)
			}
			defer lock.Release()
			cfg := &Config{Name: name, Provider: path, Socket: sd.File(name, ".sock"), VolumeID: mk.VolumeID()}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ready := make(chan *Record, 1)
			done := make(chan error, 1)
			go func() { done <- Run(ctx, cfg, sd, p, copyKey(t, mk), nil, func(r *Record) { ready <- r }) }()
			select {
			case <-ready:
			case err := <-done:
				t.Fatalf("Run: %v", err)
			}
			dial := func() *nbdclient.Client {
				c, err := nbdclient.Dial("unix", cfg.Socket, "")
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				return c
			}
			a, b := bytes.Repeat([]byte{0xa1}, 64<<10), bytes.Repeat([]byte{0xb2}, 64<<10)
			c := dial()
			if err := c.WriteAt(a, 0, false); err != nil {
				t.Fatal(err)
			}
			// Not flushed: the suspend commits it.
			if err := c.WriteAt(a, 1<<20, false); err != nil {
				t.Fatal(err)
			}
			ctl := sd.ControlSocket(name)
			var st Status
			if err := control.Call(ctx, ctl, OpSuspend, nil, nil, &st); err != nil {
				t.Fatal(err)
			}
			if st.State != StateSuspended || st.SuspendedSince.IsZero() {
				t.Fatalf("status after suspend: %+v", st)
			}
			if err := control.Call(ctx, ctl, OpSuspend, nil, nil, nil); !errors.Is(err, &control.Error{Code: CodeSuspended}) {
				t.Fatalf("a second suspend: %v", err)
			}

			// Three clients send requests while the volume is suspended.
			var returned atomic.Int32
			results := make(chan error, 3)
			got := make([]byte, len(a))
			for i, f := range []func(*nbdclient.Client) error{
				func(c *nbdclient.Client) error { return c.WriteAt(b, 64<<10, true) },
				func(c *nbdclient.Client) error { return c.ReadAt(got, 0) },
				func(c *nbdclient.Client) error { return c.Flush() },
			} {
				c := dial()
				go func() {
					err := f(c)
					returned.Add(1)
					if err != nil {
						err = fmt.Errorf("request %d: %w", i, err)
					}
					results <- err
				}()
			}
			deadline := time.Now().Add(time.Minute) // a hang guard
			for liveStatus(t, sd, name).Held < 3 {
				if time.Now().After(deadline) {
					t.Fatalf("the requests were not held: %+v", liveStatus(t, sd, name))
				}
				time.Sleep(10 * time.Millisecond)
			}

			// A wrong key changes nothing.
			wrong, err := keys.GenerateMasterKey()
			if err != nil {
				t.Fatal(err)
			}
			defer wrong.Wipe()
			err = control.Call(ctx, ctl, OpResume, nil, wrong.Bytes(), nil)
			if !errors.Is(err, &control.Error{Code: CodeWrongKey}) {
				t.Fatalf("resume with a wrong key: %v", err)
			}
			time.Sleep(50 * time.Millisecond)
			if st := liveStatus(t, sd, name); st.State != StateSuspended || st.Held != 3 || returned.Load() != 0 {
				t.Fatalf("after a wrong key: state %s, %d held, %d returned", st.State, st.Held, returned.Load())
			}

			if err := control.Call(ctx, ctl, OpResume, nil, mk.Bytes(), &st); err != nil {
				t.Fatal(err)
			}
			if st.State != StateServing {
				t.Errorf("status after resume: %+v", st)
			}
			for range 3 {
				if err := <-results; err != nil {
					t.Error(err)
				}
			}
			if !bytes.Equal(got, a) {
				t.Error("a read held over the suspend returned other data")
			}
			if err := control.Call(ctx, ctl, OpResume, nil, mk.Bytes(), nil); !errors.Is(err, &control.Error{Code: CodeNotSuspended}) {
				t.Fatalf("resume of a serving volume: %v", err)
			}

			// Suspended again, then stopped: the held write fails, what came before stays.
			if err := control.Call(ctx, ctl, OpSuspend, nil, nil, nil); err != nil {
				t.Fatal(err)
			}
			held := make(chan error, 1)
			go func() { held <- dial().WriteAt(bytes.Repeat([]byte{0xcc}, 4096), 0, false) }()
			for liveStatus(t, sd, name).Held < 1 {
				time.Sleep(10 * time.Millisecond)
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run stopped while suspended: %v", err)
			}
			if err := <-held; err == nil {
				t.Error("a write held when the suspended server stopped succeeded")
			}
			v, err := Open(p, copyKey(t, mk), Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer v.Close()
			if r := v.Recovery(); mode.Authenticated() && r.Journal != "empty" {
				t.Errorf("journal %q after a stop while suspended, want empty", r.Journal)
			}
			all := make([]byte, 2<<20)
			if err := v.ReadAt(all, 0); err != nil {
				t.Fatal(err)
			}
			want := make([]byte, 2<<20)
			copy(want, a)
			copy(want[64<<10:], b)
			copy(want[1<<20:], a)
			if mode.Authenticated() && !bytes.Equal(all, want) {
				t.Error("the volume after a stop while suspended is not what was written")
			} else if !bytes.Equal(all[:128<<10], want[:128<<10]) || !bytes.Equal(all[1<<20:1<<20+64<<10], a) {
				t.Error("the written sectors after a stop while suspended are not what was written")
			}
		})
	}
}

// TestShutdownSuspendedKeepingDevice: a suspended server stopped with its kernel device
// kept (KeepDevice: a supervisor's stop, the device still mounted) leaves the requests it
// holds unanswered, for the kernel to send again to the next server, rather than failing
// them; stopped without, it fails them with an error reply. Either way the stop is quick.
func TestShutdownSuspendedKeepingDevice(t *testing.T) {
	for _, keep := range []bool{false, true} {
		t.Run(fmt.Sprintf("keep=%v", keep), func(t *testing.T) {
			var calls []int
			srv := kernelTestServer(t, &calls)
			srv.kdev = &fakeKernelDevice{}
			fakeInFlight(t, func() (int, error) { return 0, nil })
			c, err := nbdclient.Dial("unix", srv.cfg.Socket, "")
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if err := srv.Suspend(context.Background()); err != nil {
				t.Fatal(err)
			}
			held := make(chan error, 1)
			go func() { held <- c.WriteAt(make([]byte, 4096), 0, false) }()
			for srv.vol.dev.Held() < 1 {
				time.Sleep(time.Millisecond)
			}
			if keep {
				srv.KeepDevice()
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			if err := srv.Shutdown(ctx); err != nil {
				t.Fatalf("Shutdown of a suspended server: %v", err)
			}
			if took := time.Since(start); took > 10*time.Second {
				t.Errorf("Shutdown of a suspended server took %v: it waited for what it holds", took)
			}
			err = <-held
			var reply *nbdclient.Error
			switch {
			case err == nil:
				t.Fatal("a held write succeeded after a stop")
			case keep && errors.As(err, &reply):
				t.Fatalf("kept device: the held write was answered (%v), not left for the next server", err)
			case !keep && !errors.As(err, &reply):
				t.Fatalf("the held write was not answered with an error: %v", err)
			}
			if keep != (len(calls) == 0) {
				t.Errorf("keep %v: disconnects %v", keep, calls)
			}
		})
	}
}

// fakeKernelDevice records the timeouts a suspend sets; fail fails the next SetTimeout.
type fakeKernelDevice struct {
	set  []time.Duration
	fail error
}

func (f *fakeKernelDevice) SetTimeout(d time.Duration) error {
	f.set = append(f.set, d)
	err := f.fail
	f.fail = nil
	return err
}

func (f *fakeKernelDevice) Close() error { return nil }

// fakeInFlight makes the kernel device's requests in flight what n says, until the test
// ends (not for parallel tests).
func fakeInFlight(t *testing.T, n func() (int, error)) {
	old := inFlight
	inFlight = func(int) (int, error) { return n() }
	t.Cleanup(func() { inFlight = old })
}

// TestSuspendKernelDevice: with a kernel device, suspend raises its timeouts before it
// holds anything and waits until the device has had no request in flight; resume puts
// them back. A device that never drains within the suspend's context, or a raise that
// fails, leaves the volume serving with its timeouts put back.
func TestSuspendKernelDevice(t *testing.T) {
	var calls []int
	srv := kernelTestServer(t, &calls)
	kd := &fakeKernelDevice{}
	srv.kdev = kd
	restored := time.Duration(srv.cfg.kernelTimeout()) * time.Second

	// Requests in flight: 2, then 1, then none; the volume must still serve meanwhile.
	var polls atomic.Int32
	fakeInFlight(t, func() (int, error) {
		if ok, _ := srv.vol.Suspended(); ok {
			t.Error("the volume was suspended before the kernel device drained")
		}
		return max(0, 2-int(polls.Add(1))+1), nil
	})
	if err := srv.Suspend(context.Background()); err != nil {
		t.Fatal(err)
	}
	if ok, _ := srv.vol.Suspended(); !ok || polls.Load() < 3 {
		t.Fatalf("suspended %v after %d looks at the device", ok, polls.Load())
	}
	if len(kd.set) != 1 || kd.set[0] != suspendedKernelTimeout {
		t.Fatalf("timeouts set by the suspend: %v", kd.set)
	}
	if err := srv.Resume(unlockTestVolume(t, srv.cfg.Provider)); err != nil {
		t.Fatal(err)
	}
	if len(kd.set) != 2 || kd.set[1] != restored {
		t.Fatalf("timeouts after the resume: %v, want %v back", kd.set, restored)
	}

	// Never drained: the suspend gives up with its context, and nothing changed.
	fakeInFlight(t, func() (int, error) { return 1, nil })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := srv.Suspend(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("suspend of a device that never drains: %v", err)
	}
	if ok, _ := srv.vol.Suspended(); ok || len(kd.set) != 4 || kd.set[2] != suspendedKernelTimeout || kd.set[3] != restored {
		t.Fatalf("after a suspend that gave up: suspended %v, timeouts %v", ok, kd.set)
	}

	// The raise fails.
	fakeInFlight(t, func() (int, error) { return 0, nil })
	kd.fail = errors.New("netlink says no")
	if err := srv.Suspend(context.Background()); err == nil {
		t.Fatal("a suspend whose raise failed succeeded")
	}
	if ok, _ := srv.vol.Suspended(); ok || kd.set[len(kd.set)-1] != restored {
		t.Fatalf("after a failed raise: suspended %v, timeouts %v", ok, kd.set)
	}

	// No sockets kept: refused.
	srv.kdev = nil
	if err := srv.Suspend(context.Background()); err == nil {
		t.Fatal("a suspend without the kernel device's sockets succeeded")
	}
	srv.Shutdown(context.Background())
}

// unlockTestVolume is the master key of testVolume's provider at path.
func unlockTestVolume(t *testing.T, path string) *keys.MasterKey {
	t.Helper()
	p, err := provider.Open(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	mk, _, err := h.Unlock(keys.Credentials{Passphrase: []byte("test")}, keys.AnySlot)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mk.Wipe)
	return mk
}

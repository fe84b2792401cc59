package volume

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
)

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

// TestSuspendDuringShutdown: a suspend that waits for the kernel device to drain when
// the server is told to stop (eli suspend and eli detach at once) gives up at once,
// without touching the device or its sockets, which the shutdown disconnects and closes;
// a suspend or a resume after it is refused. The race detector watches the device's
// fields, which the suspend read while the shutdown cleared them.
func TestSuspendDuringShutdown(t *testing.T) {
	var calls []int
	srv := kernelTestServer(t, &calls)
	kd := &fakeKernelDevice{}
	srv.kdev = kd
	polled := make(chan struct{}, 1)
	old := inFlight
	inFlight = func(idx int) (int, error) {
		select {
		case polled <- struct{}{}:
		default:
		}
		if idx < 0 {
			return 0, fmt.Errorf("/dev/nbd%d: no such device", idx) // as nbdkernel.InFlight says
		}
		return 1, nil // never drains
	}
	t.Cleanup(func() { inFlight = old })
	suspended := make(chan error, 1)
	go func() { suspended <- srv.Suspend(context.Background()) }()
	<-polled
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	select {
	case err := <-suspended:
		if !errors.Is(err, ErrStopping) {
			t.Errorf("a suspend cut short by Shutdown: %v, want ErrStopping", err)
		}
	case <-time.After(20 * time.Second): // a hang guard
		t.Fatal("a suspend under way went on after Shutdown returned")
	}
	if len(calls) != 1 {
		t.Errorf("disconnects %v, want one", calls)
	}
	if err := srv.Suspend(context.Background()); !errors.Is(err, ErrStopping) {
		t.Errorf("a suspend after Shutdown: %v, want ErrStopping", err)
	}
	if err := srv.Resume(unlockTestVolume(t, srv.cfg.Provider)); !errors.Is(err, ErrStopping) {
		t.Errorf("a resume after Shutdown: %v, want ErrStopping", err)
	}
}

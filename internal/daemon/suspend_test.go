package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
)

// liveStatus asks the server of name for its status over the control socket.
func liveStatus(t *testing.T, sd StateDir, name string) volume.Status {
	t.Helper()
	var st volume.Status
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
			path, _, mk := elitest.Volume(t, t.TempDir(), 8<<20, mode)
			defer mk.Wipe()
			p, err := provider.Open(path, false)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			sd := StateDir{Path: shortDir(t)}
			name := "s"
			cfg := &Setup{Config: volume.Config{Name: name, Provider: path, Socket: sd.File(name, ".sock"), VolumeID: mk.VolumeID()}}
			cancel, done := startRun(t, sd, cfg, p, elitest.CopyKey(t, mk))
			ctx := context.Background() // the control calls'; cancel stops the server
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
			var st volume.Status
			if err := control.Call(ctx, ctl, OpSuspend, nil, nil, &st); err != nil {
				t.Fatal(err)
			}
			if st.State != volume.StateSuspended || st.SuspendedSince.IsZero() {
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
			if st := liveStatus(t, sd, name); st.State != volume.StateSuspended || st.Held != 3 || returned.Load() != 0 {
				t.Fatalf("after a wrong key: state %s, %d held, %d returned", st.State, st.Held, returned.Load())
			}

			if err := control.Call(ctx, ctl, OpResume, nil, mk.Bytes(), &st); err != nil {
				t.Fatal(err)
			}
			if st.State != volume.StateServing {
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
			v, err := volume.Open(p, elitest.CopyKey(t, mk), volume.Options{})
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

// stallingProvider holds its first Sync after it is armed until release is closed: a
// flush in flight, which a stopping server waits for.
type stallingProvider struct {
	*provider.File
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (s *stallingProvider) Sync() error {
	if s.armed.CompareAndSwap(true, false) {
		close(s.entered)
		<-s.release
	}
	return s.File.Sync()
}

// TestSuspendWhileStopping: a suspend that comes while the server stops (eli suspend
// beside eli detach) is refused at once as such, and the server stops as it would have
// without it, losing nothing.
func TestSuspendWhileStopping(t *testing.T) {
	t.Parallel()
	path, _, mk := elitest.Volume(t, t.TempDir(), 8<<20, sector.Default)
	defer mk.Wipe()
	f, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := &stallingProvider{File: f, entered: make(chan struct{}), release: make(chan struct{})}
	sd := StateDir{Path: shortDir(t)}
	name := "s"
	cfg := &Setup{Config: volume.Config{Name: name, Provider: path, Socket: sd.File(name, ".sock"), VolumeID: mk.VolumeID()}}
	cancel, done := startRun(t, sd, cfg, p, elitest.CopyKey(t, mk))
	c, err := nbdclient.Dial("unix", cfg.Socket, "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	data := bytes.Repeat([]byte{0x5a}, 4096)
	if err := c.WriteAt(data, 0, false); err != nil {
		t.Fatal(err)
	}
	p.armed.Store(true)
	flushed := make(chan error, 1)
	go func() { flushed <- c.Flush() }()
	released := false
	release := func() {
		if !released {
			released = true
			close(p.release)
		}
	}
	defer release()
	select {
	case <-p.entered:
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("the flush never reached the provider")
	}
	cancel() // eli detach: the server waits for the flush in flight
	// Its NBD socket goes once its shutdown has begun.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		c, err := nbdclient.Dial("unix", cfg.Socket, "")
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("the server still takes NBD clients after it was told to stop")
		}
	}
	if st := liveStatus(t, sd, name); st.State != volume.StateStopping {
		t.Errorf("state while the server stops: %s", st.State)
	}
	ctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	if err := control.Call(ctx, sd.ControlSocket(name), OpSuspend, nil, nil, nil); !errors.Is(err, &control.Error{Code: CodeStopping}) {
		t.Errorf("a suspend while the server stops: %v, want %s", err, CodeStopping)
	}
	release()
	if err := <-flushed; err != nil {
		t.Errorf("the flush in flight as the server stopped: %v", err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("the server did not stop")
	}
	v, err := volume.Open(f, elitest.CopyKey(t, mk), volume.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	got := make([]byte, len(data))
	if err := v.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
		t.Errorf("the write flushed as the server stopped: %v, equal %v", err, bytes.Equal(got, data))
	}
}

package daemon

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
)

// shortDir is a directory whose path leaves room for a socket's name.
func shortDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "vol")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// failingProvider fails every write and sync once armed, as a full disk does.
type failingProvider struct {
	*provider.File
	armed atomic.Bool
}

func (f *failingProvider) WriteAt(b []byte, off int64) (int, error) {
	if f.armed.Load() {
		return 0, syscall.ENOSPC
	}
	return f.File.WriteAt(b, off)
}

func (f *failingProvider) Sync() error {
	if f.armed.Load() {
		return syscall.ENOSPC
	}
	return f.File.Sync()
}

func generateKey(t *testing.T) *keys.MasterKey {
	t.Helper()
	mk, err := keys.GenerateMasterKey()
	if err != nil {
		t.Fatal(err)
	}
	return mk
}

// TestRunLifecycle: Run records the volume and keeps its status in the state directory
// while it serves, and a clean stop leaves nothing there; a provider failure shows as
// the failed state at once, and the stopped server leaves its final status (what failed,
// what the data is worth) and its log, and nothing else.
func TestRunLifecycle(t *testing.T) {
	t.Parallel()
	for _, fail := range []bool{false, true} {
		name := map[bool]string{false: "clean", true: "failed"}[fail]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// A onetime volume: Run formats it, and it needs no header.
			path := filepath.Join(t.TempDir(), "v.img")
			if err := os.WriteFile(path, make([]byte, 8<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			mk := generateKey(t)
			pf, err := provider.Open(path, false)
			if err != nil {
				t.Fatal(err)
			}
			defer pf.Close()
			p := &failingProvider{File: pf}
			sd := StateDir{Path: shortDir(t)}
			lock, err := sd.LockName(name)
			if err != nil {
				t.Fatal(err)
			}
			// A log as the background server has one: kept only if the volume fails.
			if err := os.WriteFile(sd.File(name, ".log"), []byte("log\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg := &Setup{Config: volume.Config{Name: name, Provider: path, Socket: sd.File(name, ".sock"),
				Onetime: true, Mode: sector.Default, SectorSize: 4096, VolumeID: mk.VolumeID()}, LogFile: sd.File(name, ".log")}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ready := make(chan *Record, 1)
			done := make(chan error, 1)
			go func() { done <- Run(ctx, cfg, sd, p, mk, nil, func(r *Record) { ready <- r }) }()
			var rec *Record
			select {
			case rec = <-ready:
			case err := <-done:
				t.Fatalf("Run failed before it was ready: %v", err)
			}
			if got, err := sd.ReadRecord(name); err != nil || got.Pid != os.Getpid() || got.URI != rec.URI {
				t.Fatalf("record: %+v, %v", got, err)
			}
			if st, err := sd.ReadStatus(name); err != nil || st.State != volume.StateServing || st.Name != name {
				t.Fatalf("status once ready: %+v, %v", st, err)
			}
			// The control socket answers once the server is ready.
			var live volume.Status
			if err := control.Call(ctx, sd.ControlSocket(name), OpStatus, nil, nil, &live); err != nil ||
				live.State != volume.StateServing || live.Name != name || live.Pid != os.Getpid() {
				t.Fatalf("status through the control socket: %+v, %v", live, err)
			}

			c, err := nbdclient.Dial("unix", cfg.Socket, "")
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if err := c.WriteAt(bytes.Repeat([]byte{7}, 8192), 0, false); err != nil {
				t.Fatal(err)
			}
			if err := c.Flush(); err != nil {
				t.Fatal(err)
			}
			// It answers what the server counts now, without the status file's lag.
			if err := control.Call(ctx, sd.ControlSocket(name), OpStatus, nil, nil, &live); err != nil || live.Writes != 1 || live.Flushes != 1 {
				t.Errorf("status through the control socket after a write and a flush: %+v, %v", live, err)
			}
			if fail {
				p.armed.Store(true)
				c.WriteAt(bytes.Repeat([]byte{8}, 8192), 8192, false)
				if err := c.Flush(); err == nil {
					t.Fatal("flush on a failing provider succeeded")
				}
			}
			// The status follows: at once for a failure, within statusEvery for counters.
			want := volume.StateServing
			if fail {
				want = volume.StateFailed
			}
			deadline := time.Now().Add(time.Minute) // a hang guard, not a timing assertion
			for {
				st, err := sd.ReadStatus(name)
				if err == nil && st.State == want && st.Writes >= 1 && st.Flushes >= 1 {
					if fail && !strings.Contains(st.Error, "no space left") {
						t.Errorf("failed status names no cause: %+v", st)
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("status never showed %s with the requests: %+v, %v", want, st, err)
				}
				time.Sleep(10 * time.Millisecond)
			}
			c.Close()

			cancel()
			err = <-done
			pf.Close()
			lock.Release()
			if fail != (err != nil) {
				t.Fatalf("Run returned %v; want an error iff the provider failed", err)
			}
			for _, ext := range []string{".json", ".sock", ".lock", ".ctl"} {
				if _, err := os.Stat(sd.File(name, ext)); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s%s left behind: %v", name, ext, err)
				}
			}
			st, serr := sd.ReadStatus(name)
			_, lerr := os.Stat(sd.File(name, ".log"))
			if !fail {
				if !errors.Is(serr, os.ErrNotExist) || !errors.Is(lerr, os.ErrNotExist) {
					t.Errorf("a clean stop left its status (%v) or log (%v)", serr, lerr)
				}
				if ents, _ := os.ReadDir(sd.Path); len(ents) != 0 {
					t.Errorf("state directory after a clean stop: %v", ents)
				}
				return
			}
			if serr != nil || lerr != nil {
				t.Fatalf("a failed server must keep its status (%v) and log (%v)", serr, lerr)
			}
			if st.State != volume.StateStopped || !st.Failed() || !strings.Contains(st.Error, "no space left") ||
				!strings.Contains(st.Final, "no space left") || !st.Authenticated {
				t.Errorf("final status %+v; want the failure, as error and final commit, of a volume with a journal", st)
			}
			// The next attach of the name clears them.
			sd.Cleanup(name, nil, true)
			if ents, _ := os.ReadDir(sd.Path); len(ents) != 0 {
				t.Errorf("state directory after the next attach's cleanup: %v", ents)
			}
		})
	}
}

// TestRunListenFailureTouchesNothing: a socket that cannot be bound fails Run before
// the provider is opened: a onetime volume's provider is not formatted.
func TestRunListenFailureTouchesNothing(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "p.img")
	orig := bytes.Repeat([]byte("not eli"), 1<<17)
	if err := os.WriteFile(path, orig, 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	mk := generateKey(t)
	cfg := &Setup{Config: volume.Config{Name: "x", Provider: path, Socket: "/proc/eli-cannot-be-here.sock", Onetime: true, Mode: sector.Default, SectorSize: 4096, VolumeID: mk.VolumeID()}}
	sd := StateDir{Path: shortDir(t)}
	err = Run(context.Background(), cfg, sd, p, mk, nil, func(*Record) { t.Error("ready called") })
	if err == nil || !strings.Contains(err.Error(), "listen") {
		t.Fatalf("Run on an unusable socket: %v", err)
	}
	if got, _ := os.ReadFile(path); !bytes.Equal(got, orig) {
		t.Error("a failed listen changed the provider")
	}
	if ents, _ := os.ReadDir(sd.Path); len(ents) != 0 {
		t.Errorf("a failed start left %v", ents)
	}
}

// startRun runs cfg's server in the background under the name lock it takes, and
// returns once it serves; done receives Run's result, cancel stops it.
func startRun(t *testing.T, sd StateDir, cfg *Setup, p provider.Provider, mk *keys.MasterKey) (cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	lock, err := sd.LockName(cfg.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(lock.Release)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ready := make(chan *Record, 1)
	result := make(chan error, 1)
	go func() { result <- Run(ctx, cfg, sd, p, mk, nil, func(r *Record) { ready <- r }) }()
	select {
	case <-ready:
	case err := <-result:
		t.Fatalf("Run: %v", err)
	}
	return cancel, result
}

package faultproxy_test

import (
	"bytes"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/faultproxy"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/nbdclient"
)

// server starts nbdkit's memory plugin on a unix socket in dir.
func server(t *testing.T, dir, name string) string {
	t.Helper()
	nbdkit := testtool.Need(t, "nbdkit", "nbdkit")
	sock := filepath.Join(dir, name)
	cmd := exec.Command(nbdkit, "-f", "--exit-with-parent", "-U", sock, "memory", "4M")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return sock
		}
		if time.Now().After(deadline) {
			t.Fatal("nbdkit did not start")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func proxy(t *testing.T, upstream string) (*faultproxy.Proxy, string) {
	t.Helper()
	p := faultproxy.New("unix", upstream, t.Logf)
	sock := filepath.Join(filepath.Dir(upstream), "proxy")
	if err := p.Listen("unix", sock); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, sock
}

func open(t *testing.T, sock string, simple bool) *nbdclient.Remote {
	t.Helper()
	r, err := nbdclient.Open("nbd+unix:///?socket="+sock, &nbdclient.Options{
		SimpleReplies: simple, RequestTimeout: 2 * time.Second, BackoffMax: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// TestFaults: each fault does what it says to a real client of a real server, with
// structured and with simple replies.
func TestFaults(t *testing.T) {
	for _, simple := range []bool{false, true} {
		name := "structured"
		if simple {
			name = "simple"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir, err := os.MkdirTemp("", "fp")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			up := server(t, dir, "up")
			p, sock := proxy(t, up)
			r := open(t, sock, simple)
			data := bytes.Repeat([]byte("faultproxy"), 410)[:4096]
			got := make([]byte, 4096)
			if _, err := r.WriteAt(data, 8192); err != nil {
				t.Fatal(err)
			}
			if _, err := r.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read through the proxy: %v", err)
			}

			p.FailWrites(true)
			if _, err := r.WriteAt(data, 0); !errors.Is(err, syscall.EIO) {
				t.Fatalf("write with FailWrites: %v, want EIO", err)
			}
			if _, err := r.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read with FailWrites: %v", err)
			}
			if err := r.Sync(); err != nil {
				t.Fatalf("flush with FailWrites: %v", err)
			}
			p.FailWrites(false)

			p.FailReads(1)
			if _, err := r.ReadAt(got, 8192); !errors.Is(err, syscall.EIO) {
				t.Fatalf("read with FailReads(1): %v, want EIO", err)
			}
			p.FailReads(0)
			if st := p.Stats(); st.Injected != 2 {
				t.Fatalf("%d requests answered by the proxy, want 2", st.Injected)
			}

			p.Stall()
			done := make(chan error, 1)
			go func() {
				_, err := r.ReadAt(got, 8192)
				done <- err
			}()
			select {
			case err := <-done:
				t.Fatalf("a read returned while stalled: %v", err)
			case <-time.After(300 * time.Millisecond):
			}
			p.Resume()
			if err := <-done; err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read held by the stall: %v", err)
			}

			p.Kill()
			if _, err := net.Dial("unix", sock); err == nil {
				t.Fatal("the killed proxy still accepts connections")
			}
			if err := p.Restart(); err != nil {
				t.Fatal(err)
			}
			// The client reconnects on its own.
			if _, err := r.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read after the restart: %v", err)
			}
			p.Cut()
			if _, err := r.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read after a cut: %v", err)
			}
			if r.Reconnections() < 2 {
				t.Fatalf("%d reconnections after a kill and a cut", r.Reconnections())
			}

			// Another export behind the same address.
			other := server(t, dir, "other")
			p.SetUpstream("unix", other)
			p.Cut()
			if _, err := r.ReadAt(got, 8192); err != nil || !bytes.Equal(got, make([]byte, 4096)) {
				t.Fatalf("read from the other export: %v (want its zeroes)", err)
			}
		})
	}
}

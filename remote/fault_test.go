package remote

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
)

// fileExport serves a new file of 16 MiB with nbdkit's file plugin on a unix socket in
// dir, behind a fault proxy; it returns the file, the server's socket, the proxy and
// the URI to give Open.
func fileExport(t *testing.T, dir, name string) (file, sock string) {
	t.Helper()
	bin := testtool.Need(t, "nbdkit", "nbdkit")
	file = filepath.Join(dir, name+".img")
	if err := os.WriteFile(file, make([]byte, 16<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	sock = filepath.Join(dir, name+".sock")
	cmd := exec.Command(bin, "-f", "--exit-with-parent", "-U", sock, "file", file)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return file, sock
		}
		if time.Now().After(deadline) {
			t.Fatal("nbdkit did not start")
		}
	}
}

func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "rf")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func proxied(t *testing.T, dir, upstream string) (*faultproxy.Proxy, string) {
	t.Helper()
	p := faultproxy.New("unix", upstream, t.Logf)
	sock := filepath.Join(dir, "proxy.sock")
	if err := p.Listen("unix", sock); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, "nbd+unix:///?socket=" + sock
}

// TestExportReplacedFences: the export behind the URI is swapped for another one while
// a Store holds the volume. The reconnection finds the mark is not its own and stops
// before replaying anything: writes fail, and the other export is untouched.
func TestExportReplacedFences(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	_, sock := fileExport(t, dir, "a")
	otherFile, otherSock := fileExport(t, dir, "b")
	p, uri := proxied(t, dir, sock)
	s, err := Open(uri, &Options{RequestTimeout: 500 * time.Millisecond, QueueTimeout: 10 * time.Second, Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Claim(ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.WriteAt(bytes.Repeat([]byte{3}, 4096), 65536); err != nil { // acknowledged, not flushed
		t.Fatal(err)
	}
	p.SetUpstream("unix", otherSock)
	p.Cut()
	if err := s.Sync(); !errors.Is(err, syscall.EIO) {
		t.Fatalf("flush after the export was replaced: %v, want EIO", err)
	}
	if _, err := s.WriteAt(make([]byte, 4096), 0); !errors.Is(err, ErrTakenOver) && !errors.Is(err, ErrExportChanged) {
		t.Fatalf("write after the export was replaced: %v", err)
	}
	if s.Fenced() == nil {
		t.Fatal("the Store is not fenced")
	}
	if h := s.Health(); h.Broken == nil {
		t.Fatalf("health does not say the export changed: %+v", h)
	}
	b, err := os.ReadFile(otherFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, make([]byte, len(b))) {
		t.Fatal("a write or the mark reached the other export")
	}
}

// TestMarkIOBounded: with the storage gone and calls held for a long QueueTimeout, the
// heartbeat and the release at Close are still bounded by the request timeout, so that
// a server that stops ends.
func TestMarkIOBounded(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	_, sock := fileExport(t, dir, "a")
	p, uri := proxied(t, dir, sock)
	const rt = 300 * time.Millisecond
	s, err := Open(uri, &Options{RequestTimeout: rt, QueueTimeout: time.Hour, Interval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Claim(ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	p.Kill()
	time.Sleep(200 * time.Millisecond) // a heartbeat is under way
	start := time.Now()
	err = s.Close()
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("Close with the storage gone took %v; its requests are bounded by %v", d, rt)
	}
	if err == nil {
		t.Fatal("Close reported the mark released with the storage gone")
	}
}

// TestProbe: a read-only user is refused a volume whose owner heartbeats, and let
// through one whose owner is gone or that nobody holds; it writes no mark.
func TestProbe(t *testing.T) {
	path := newExport(t)
	ro := fileStore(t, path)
	if err := ro.Probe(ClaimOptions{}); err != nil {
		t.Fatalf("probe of a volume nobody holds: %v", err)
	}
	if m, _ := ro.readMark(); m.State != Empty {
		t.Fatalf("probe wrote a mark: %+v", m)
	}
	a := fileStore(t, path)
	if err := a.Claim(ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	var held *HeldError
	if err := ro.Probe(ClaimOptions{}); !errors.As(err, &held) {
		t.Fatalf("probe of a live volume: %v, want HeldError", err)
	}
	if _, err := a.Handoff(); err != nil { // its heartbeat stops, the mark stays
		t.Fatal(err)
	}
	if err := ro.Probe(ClaimOptions{}); err != nil {
		t.Fatalf("probe of a volume whose owner is gone: %v", err)
	}
}

package volume

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// shortDir is a directory for unix sockets, whose paths are limited to 108 bytes (a
// subtest's t.TempDir comes close).
func shortDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "vol")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// TestErrorOffsetEndToEnd: a real client (libnbd) reading over a tampered sector through
// the real server on a unix socket gets NBD_REPLY_TYPE_ERROR_OFFSET with the sector's
// offset and EIO; and NBD_CMD_CACHE reaches the device.
func TestErrorOffsetEndToEnd(t *testing.T) {
	t.Parallel()
	py := testtool.NeedPythonNBD(t)
	dir := t.TempDir()
	path, l, mk := testVolume(t, dir, 16<<20, sector.Default)
	defer mk.Wipe()
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	cfg := &Config{Name: "t", Provider: path, Socket: filepath.Join(shortDir(t), "t.sock")}
	srv, err := Start(cfg, p, copyKey(t, mk), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := srv.Shutdown(context.Background()); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	}()
	uri := UnixURI(cfg.Socket)

	run := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(py, append([]string{"testdata/readchunks.py"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("readchunks.py %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	// CACHE first, on a volume nothing has read yet: it loads the metadata block.
	if out := run("cache", uri, "0", fmt.Sprint(64*l.SectorSize)); !strings.Contains(out, "cache ok") {
		t.Fatalf("cache: %s", out)
	}
	if st := srv.Volume().Status(); st.Caches != 1 {
		t.Errorf("NBD_CMD_CACHE did not reach the volume: %+v", st)
	}
	if st := srv.Volume().dev.Stats(); st.CacheLoads == 0 {
		t.Errorf("NBD_CMD_CACHE did not reach the device's metadata cache: %+v", st)
	}

	s := int64(l.SectorSize)
	c, err := nbdclient.Dial("unix", cfg.Socket, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.WriteAt(bytes.Repeat([]byte{0x42}, int(8*s)), 0, true); err != nil {
		t.Fatal(err)
	}
	c.Close()
	flipByte(t, path, l.DataPos(5)+100)

	for _, tc := range []struct {
		off, n int64
		want   string
	}{
		{0, 8 * s, fmt.Sprintf("error %d 5", 5*s)},
		{4 * s, 3 * s, fmt.Sprintf("error %d 5", 5*s)},
		{5*s + 512, 1024, fmt.Sprintf("error %d 5", 5*s+512)},
	} {
		out := run(uri, fmt.Sprint(tc.off), fmt.Sprint(tc.n))
		if !strings.Contains(out, tc.want+"\n") || !strings.Contains(out, "result err EIO") {
			t.Errorf("read [%d, +%d): libnbd saw\n%swant an ERROR_OFFSET chunk %q and EIO", tc.off, tc.n, out, tc.want)
		}
	}
	if out := run(uri, "0", fmt.Sprint(4*s)); !strings.Contains(out, "result ok") {
		t.Errorf("read of the untouched sectors: %s", out)
	}
}

// TestShutdownDisconnectsKernelOnce: the server's Shutdown is the one place that
// disconnects the kernel device, once, however often it is called (eli detach no longer
// does it too: two disconnects filled the logs with netlink and kernel errors).
// kernelTestServer is a started server whose Shutdown disconnects into calls instead of
// the kernel, as if Start had connected /dev/nbd3. Not for parallel tests: it replaces
// the package's disconnect function until the test ends.
func kernelTestServer(t *testing.T, calls *[]int) *Server {
	old := disconnect
	disconnect = func(i int) error { *calls = append(*calls, i); return nil }
	t.Cleanup(func() { disconnect = old })

	path, _, mk := testVolume(t, t.TempDir(), 8<<20, sector.Default)
	t.Cleanup(mk.Wipe)
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	srv, err := Start(&Config{Name: "k", Provider: path, Socket: filepath.Join(shortDir(t), "k.sock")}, p, copyKey(t, mk), nil)
	if err != nil {
		t.Fatal(err)
	}
	srv.devIndex = 3
	return srv
}

func TestShutdownDisconnectsKernelOnce(t *testing.T) {
	var calls []int
	srv := kernelTestServer(t, &calls)
	if err := srv.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := srv.Shutdown(context.Background()); err != nil {
		t.Errorf("second Shutdown: %v", err)
	}
	if len(calls) != 1 || calls[0] != 3 {
		t.Fatalf("disconnect calls %v, want one of device 3", calls)
	}
}

// TestKeepDeviceLeavesKernelConnected: after KeepDevice, Shutdown still closes the volume
// but never disconnects the kernel device, which the next attach re-plugs.
func TestKeepDeviceLeavesKernelConnected(t *testing.T) {
	var calls []int
	srv := kernelTestServer(t, &calls)
	srv.KeepDevice()
	if err := srv.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(calls) != 0 {
		t.Fatalf("disconnect calls %v after KeepDevice, want none", calls)
	}
	if !srv.closed {
		t.Fatal("Shutdown after KeepDevice did not close the volume")
	}
}

// TestKernelTimeout: the kernel device's request timeout outlasts what eli holds a
// request for its storage; with --queue-timeout forever it is the longest the kernel
// takes, never 0, which the 6.1 driver treats as 30 s with several connections.
func TestKernelTimeout(t *testing.T) {
	for _, tc := range []struct {
		provider string
		queue    time.Duration
		want     uint64
	}{
		{"/dev/sdb", 0, 30},
		{"nbd+unix:///?socket=/s", 0, 40},
		{"nbd+unix:///?socket=/s", 2 * time.Minute, 130},
		{"nbd+unix:///?socket=/s", -1, uint64(nbdkernel.MaxTimeout / time.Second)},
	} {
		cfg := &Config{Provider: tc.provider, RemoteQueueTimeout: tc.queue}
		if got := cfg.kernelTimeout(); got != tc.want {
			t.Errorf("%s, queue timeout %v: kernel timeout %d s, want %d", tc.provider, tc.queue, got, tc.want)
		}
	}
}

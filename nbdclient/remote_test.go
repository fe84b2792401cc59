package nbdclient

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/provider"
)

// image makes a sparse file of size bytes for a file-backed server.
func image(t testing.TB, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return p
}

func open(t testing.TB, uri string, o *Options) *Remote {
	t.Helper()
	r, err := Open(uri, o)
	if err != nil {
		t.Fatalf("Open(%s): %v", uri, err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// exercise runs concurrent writers over disjoint regions against a model of the export,
// reading everything back, with syncs, punches and requests larger than one payload.
func exercise(t *testing.T, r *Remote) {
	t.Helper()
	size := r.Size()
	const workers = 8
	region := size / workers
	model := make([]byte, size)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			base := int64(w) * region
			m := model[base : base+region]
			for i := range 40 {
				off := rng.Int64N(region/4096) * 4096
				n := min((1+rng.Int64N(64))*4096, region-off)
				switch rng.IntN(5) {
				case 0, 1:
					p := make([]byte, n)
					for j := range p {
						p[j] = byte(rng.Uint32())
					}
					if _, err := r.WriteAt(p, base+off); err != nil {
						errs <- err
						return
					}
					copy(m[off:], p)
				case 2:
					if err := r.Punch(base+off, n); err != nil {
						errs <- err
						return
					}
					clear(m[off : off+n])
				case 3:
					if i%10 == 3 {
						if err := r.Sync(); err != nil {
							errs <- err
							return
						}
					}
				}
				got := make([]byte, n)
				if _, err := r.ReadAt(got, base+off); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(got, m[off:off+n]) {
					errs <- errors.New("read back differs from what was written")
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := r.Sync(); err != nil {
		t.Fatal(err)
	}
	// One call over the whole export: many payloads at once, all in the model.
	got := make([]byte, size)
	if _, err := r.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model) {
		t.Fatal("whole-export read differs from the model")
	}
	// Past the end: a short read with io.EOF, as a file gives.
	n, err := r.ReadAt(make([]byte, 8192), size-4096)
	if n != 4096 || err != io.EOF {
		t.Fatalf("read across the end: %d, %v; want 4096, EOF", n, err)
	}
	if _, err := r.WriteAt(make([]byte, 4096), size); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("write past the end: %v, want EINVAL", err)
	}
}

func TestRemoteServers(t *testing.T) {
	t.Parallel()
	const size = 48 << 20
	tests := []struct {
		name     string
		srv      func(t *testing.T) *server
		opts     Options
		multi    bool // expect a pool of connections
		maxBlock uint32
	}{
		{name: "nbdkit-memory-unix", srv: func(t *testing.T) *server { return nbdkit(t, "unix", nil, "memory", "48M") }, multi: true},
		{name: "nbdkit-memory-tcp", srv: func(t *testing.T) *server { return nbdkit(t, "tcp", nil, "memory", "48M") }, multi: true},
		{name: "nbdkit-simple-replies", srv: func(t *testing.T) *server { return nbdkit(t, "unix", nil, "memory", "48M") }, opts: Options{SimpleReplies: true}, multi: true},
		{name: "nbdkit-one-conn", srv: func(t *testing.T) *server {
			return nbdkit(t, "unix", nil, "--filter=multi-conn", "memory", "48M", "multi-conn-mode=disable")
		}},
		{name: "nbdkit-blocksize-64k", srv: func(t *testing.T) *server {
			return nbdkit(t, "unix", nil, "--filter=blocksize-policy", "memory", "48M",
				"blocksize-minimum=4096", "blocksize-preferred=4096", "blocksize-maximum=65536", "blocksize-error-policy=error")
		}, multi: true, maxBlock: 65536},
		{name: "nbdkit-file-tcp", srv: func(t *testing.T) *server { return nbdkit(t, "tcp", nil, "file", image(t, size)) }, multi: true},
		{name: "qemu-nbd-unix", srv: func(t *testing.T) *server { return qemuNBD(t, "unix", image(t, size)) }, multi: true},
		{name: "qemu-nbd-tcp", srv: func(t *testing.T) *server { return qemuNBD(t, "tcp", image(t, size)) }, multi: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := tc.srv(t)
			r := open(t, s.uri, &tc.opts)
			if r.Size() != size {
				t.Fatalf("size %d, want %d", r.Size(), size)
			}
			exp := r.Export()
			if tc.multi != (r.Conns() > 1) {
				t.Errorf("%d connections with flags %#x; want a pool: %v", r.Conns(), exp.Flags, tc.multi)
			}
			if tc.maxBlock != 0 && (exp.MaxBlock != tc.maxBlock || exp.maxPayload() != tc.maxBlock) {
				t.Errorf("max block %d, payload %d; want %d", exp.MaxBlock, exp.maxPayload(), tc.maxBlock)
			}
			if exp.MinBlock > 1 {
				if _, err := r.WriteAt(make([]byte, 512), 0); !errors.Is(err, syscall.EINVAL) {
					t.Errorf("unaligned write: %v, want EINVAL", err)
				}
			}
			exercise(t, r)
			if n := r.Reconnections(); n != 0 {
				t.Errorf("%d reconnections on a healthy server", n)
			}
		})
	}
}

// TestServerErrors serves through nbdkit's error filter: a share of requests fail with
// EIO from the server, and each failure stays with its request.
func TestServerErrors(t *testing.T) {
	t.Parallel()
	s := nbdkit(t, "unix", nil, "--filter=error", "memory", "8M", "error=EIO", "error-rate=30%")
	r := open(t, s.uri, nil)
	want := bytes.Repeat([]byte{0xa5}, 4096)
	var okWrites, failed int
	for i := range 200 {
		off := int64(i%64) * 4096
		_, err := r.WriteAt(want, off)
		if err != nil {
			var ne *Error
			if !errors.As(err, &ne) || !errors.Is(err, syscall.EIO) {
				t.Fatalf("write: %v, want a server EIO", err)
			}
			failed++
			continue
		}
		okWrites++
		got := make([]byte, 4096)
		if _, err := r.ReadAt(got, off); err == nil && !bytes.Equal(got, want) {
			t.Fatal("a successful read returned wrong data")
		} else if err != nil && !errors.Is(err, syscall.EIO) {
			t.Fatalf("read: %v", err)
		}
	}
	if okWrites == 0 || failed == 0 {
		t.Fatalf("%d writes succeeded and %d failed: the filter's errors did not show", okWrites, failed)
	}
	if n := r.Reconnections(); n != 0 {
		t.Errorf("server errors caused %d reconnections", n)
	}
}

// TestSlowFailingNetwork runs concurrent writers through nbdkit's delay and error
// filters: every failure is a per-request EIO, a failed write is retried until it lands,
// every read that succeeds returns the data, and the connections survive.
func TestSlowFailingNetwork(t *testing.T) {
	t.Parallel()
	s := nbdkit(t, "tcp", nil, "--filter=error", "--filter=delay", "memory", "4M",
		"delay-read=2ms", "delay-write=5ms", "error=EIO", "error-rate=15%")
	r := open(t, s.uri, nil)
	const workers, sectors = 16, 1024
	var wg sync.WaitGroup
	var failures atomic.Int64
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 4))
			p, got := make([]byte, 4096), make([]byte, 4096)
			for v := range uint64(30) {
				sec := w + workers*rng.IntN(sectors/workers)
				sectorData(p, sec, v+1)
				for tries := 0; ; tries++ {
					_, err := r.WriteAt(p, int64(sec)*4096)
					if err == nil {
						break
					}
					if !errors.Is(err, syscall.EIO) || tries > 50 {
						errs <- fmt.Errorf("write: %v after %d tries", err, tries)
						return
					}
					failures.Add(1)
				}
				if _, err := r.ReadAt(got, int64(sec)*4096); err != nil {
					if !errors.Is(err, syscall.EIO) {
						errs <- fmt.Errorf("read: %v", err)
						return
					}
					failures.Add(1)
				} else if !bytes.Equal(got, p) {
					errs <- errors.New("a successful read returned other data than the last write")
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if failures.Load() == 0 {
		t.Fatal("the error filter injected no failures")
	}
	if n := r.Reconnections(); n != 0 {
		t.Errorf("per-request errors caused %d reconnections", n)
	}
}

// Remote is meant to stand where eli's providers stand, punching as they do.
var (
	_ provider.Provider = (*Remote)(nil)
	_                   = provider.Capabilities{Punch: (*Remote)(nil).Punch}
)

// TestDialTimeout: a server that accepts and then says nothing fails Open within the
// dial timeout, instead of hanging.
func TestDialTimeout(t *testing.T) {
	t.Parallel()
	sock := filepath.Join(t.TempDir(), "mute.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	res := make(chan error, 1)
	go func() {
		r, err := Open("nbd+unix:///?socket="+sock, &Options{DialTimeout: 200 * time.Millisecond})
		if err == nil {
			r.Close()
		}
		res <- err
	}()
	select {
	case err := <-res:
		if err == nil || !strings.Contains(err.Error(), "greeting") {
			t.Fatalf("Open of a mute server: %v, want a failure reading the greeting", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Open hung on a mute server")
	}
}

// TestExportFlags: FUA writes, trims, and a read-only export refusing writes.
func TestExportFlags(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		args     []string
		readOnly bool
		fua      bool
	}{
		{name: "fua", args: []string{"memory", "1M"}, fua: true},
		{name: "read-only", args: []string{"-r", "memory", "1M"}, readOnly: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := open(t, nbdkit(t, "unix", nil, tc.args...).uri, nil)
			flags := r.Export().Flags
			if (flags&FlagSendFUA != 0) != tc.fua || (flags&FlagReadOnly != 0) != tc.readOnly {
				t.Fatalf("flags %#x", flags)
			}
			p := bytes.Repeat([]byte{0x5a}, 8192)
			_, err := r.WriteAtFUA(p, 4096)
			if tc.readOnly {
				if !errors.Is(err, syscall.EPERM) {
					t.Fatalf("write to a read-only export: %v, want EPERM", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(p))
			if _, err := r.ReadAt(got, 4096); err != nil || !bytes.Equal(got, p) {
				t.Fatalf("FUA write read back: %v", err)
			}
			if err := r.Trim(0, 1<<20); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRefresh grows a file-backed export under the server and follows it.
func TestRefresh(t *testing.T) {
	t.Parallel()
	img := image(t, 1<<20)
	r := open(t, nbdkit(t, "unix", nil, "file", img).uri, nil)
	if n, err := r.Refresh(); err != nil || n != 1<<20 {
		t.Fatalf("Refresh of an unchanged export: %d, %v", n, err)
	}
	if err := os.Truncate(img, 4<<20); err != nil {
		t.Fatal(err)
	}
	if n, err := r.Refresh(); err != nil || n != 4<<20 || r.Size() != 4<<20 {
		t.Fatalf("Refresh after growing to 4 MiB: %d, %v", n, err)
	}
	p := bytes.Repeat([]byte{1}, 4096)
	if _, err := r.WriteAt(p, 3<<20); err != nil {
		t.Fatalf("write in the grown part: %v", err)
	}
}

// TestInFlightBound: one call many times larger than the in-flight bound goes through
// in pieces (the bound holds back its later pieces until earlier ones are answered).
func TestInFlightBound(t *testing.T) {
	t.Parallel()
	s := nbdkit(t, "unix", nil, "--filter=blocksize-policy", "memory", "8M",
		"blocksize-minimum=4096", "blocksize-preferred=4096", "blocksize-maximum=65536", "blocksize-error-policy=error")
	r := open(t, s.uri, &Options{MaxInFlight: 256 << 10, RequestTimeout: time.Minute})
	p := make([]byte, 8<<20)
	for i := range p {
		p[i] = byte(i / 4096)
	}
	if _, err := r.WriteAt(p, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(p))
	if _, err := r.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, p) {
		t.Fatal("read back differs")
	}
}

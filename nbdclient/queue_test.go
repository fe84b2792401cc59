package nbdclient

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/faultproxy"
)

// behindProxy serves a new image through a fault proxy on a unix socket and returns
// the proxy and the URI a client connects to.
func behindProxy(t *testing.T) (*faultproxy.Proxy, string, *server) {
	t.Helper()
	s := nbdkit(t, "unix", nil, "file", image(t, 8<<20))
	dir, err := os.MkdirTemp("", "nbdq")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := faultproxy.New("unix", s.addr, t.Logf)
	sock := filepath.Join(dir, "p")
	if err := p.Listen("unix", sock); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, "nbd+unix:///?socket=" + sock, s
}

// TestQueueTimeoutHoldsCalls: with QueueTimeout beyond RequestTimeout, a call made while
// the server is away waits for it (dm-multipath's queue_if_no_path, bounded), and a
// request the server stopped answering is re-sent on a new connection instead of
// failing at RequestTimeout. Without QueueTimeout both fail at RequestTimeout.
func TestQueueTimeoutHoldsCalls(t *testing.T) {
	t.Parallel()
	const rt = 300 * time.Millisecond
	p, uri, _ := behindProxy(t)
	r := open(t, uri, &Options{RequestTimeout: rt, QueueTimeout: time.Minute, BackoffMax: 50 * time.Millisecond})
	want := bytes.Repeat([]byte("queue"), 820)[:4096]
	if _, err := r.WriteAt(want, 4096); err != nil {
		t.Fatal(err)
	}

	// Gone: the write waits, then completes once the server is back.
	p.Kill()
	res := make(chan error, 1)
	go func() { _, err := r.WriteAt(want, 8192); res <- err }()
	time.Sleep(4 * rt)
	select {
	case err := <-res:
		t.Fatalf("a write returned while the server was away (%v): it should wait", err)
	default:
	}
	if h := r.Health(); h.Connected || h.DownSince.IsZero() || h.LastError == nil {
		t.Fatalf("health while away: %+v", h)
	}
	if err := p.Restart(); err != nil {
		t.Fatal(err)
	}
	if err := <-res; err != nil {
		t.Fatalf("held write after the server came back: %v", err)
	}

	// Stalled: the read's connection is dropped at RequestTimeout and the read re-sent
	// on a new one, which answers once the stall ends.
	eventually(t, "reconnected", func() error {
		if !r.Health().Connected {
			return errors.New("not connected")
		}
		return nil
	})
	redials := r.Reconnections()
	p.Stall()
	got := make([]byte, 4096)
	go func() { _, err := r.ReadAt(got, 4096); res <- err }()
	time.Sleep(4 * rt)
	p.Resume()
	if err := <-res; err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read held across a stall: %v", err)
	}
	if r.Reconnections() == redials {
		t.Fatal("the stalled connection was not replaced")
	}
	if h := r.Health(); !h.Connected || !h.DownSince.IsZero() {
		t.Fatalf("health after the stall: %+v", h)
	}

	// The same stall without QueueTimeout fails the call at RequestTimeout.
	r2 := open(t, uri, &Options{RequestTimeout: rt, BackoffMax: 50 * time.Millisecond})
	p.Stall()
	start := time.Now()
	_, err := r2.ReadAt(got, 4096)
	p.Resume()
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("stalled read without QueueTimeout: %v, want EIO", err)
	}
	if d := time.Since(start); d > 20*rt {
		t.Fatalf("stalled read failed after %v, RequestTimeout %v", d, rt)
	}
}

// TestQueueTimeoutBound: a call held for a server that does not come back fails with EIO
// once QueueTimeout has passed, not before and not long after.
func TestQueueTimeoutBound(t *testing.T) {
	t.Parallel()
	const qt = time.Second
	p, uri, _ := behindProxy(t)
	r := open(t, uri, &Options{RequestTimeout: 200 * time.Millisecond, QueueTimeout: qt, BackoffMax: 50 * time.Millisecond})
	p.Kill()
	start := time.Now()
	_, err := r.ReadAt(make([]byte, 4096), 0)
	d := time.Since(start)
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("read with the server gone for good: %v, want EIO", err)
	}
	if d < qt-50*time.Millisecond || d > qt+5*time.Second {
		t.Fatalf("the read failed after %v, want about QueueTimeout (%v)", d, qt)
	}
}

// TestSetDeadline: a call held Forever ends at the deadline SetDeadline gives, and calls
// after it fail at once; a later deadline lets them through again.
func TestSetDeadline(t *testing.T) {
	t.Parallel()
	p, uri, _ := behindProxy(t)
	r := open(t, uri, &Options{RequestTimeout: 200 * time.Millisecond, QueueTimeout: Forever, BackoffMax: 50 * time.Millisecond})
	p.Kill()
	res := make(chan error, 1)
	go func() { res <- r.Sync() }()
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	r.SetDeadline(start.Add(200 * time.Millisecond))
	select {
	case err := <-res:
		if !errors.Is(err, ErrDeadline) || !errors.Is(err, syscall.EIO) {
			t.Fatalf("held flush at the deadline: %v, want ErrDeadline", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a call held Forever outlived SetDeadline")
	}
	if _, err := r.ReadAt(make([]byte, 512), 0); !errors.Is(err, ErrDeadline) {
		t.Fatalf("read after the deadline: %v, want ErrDeadline", err)
	}
	// A context ends a held call too.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	r.SetDeadline(time.Time{})
	if _, err := r.ReadAtContext(ctx, make([]byte, 512), 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("held read at its context's end: %v, want EIO", err)
	}
	if err := p.Restart(); err != nil {
		t.Fatal(err)
	}
	r.SetDeadline(time.Now().Add(time.Minute))
	if _, err := r.ReadAt(make([]byte, 512), 0); err != nil {
		t.Fatalf("read once the server is back and the deadline moved: %v", err)
	}
}

// TestVerifyStopsOnOtherExport: after a reconnection that finds another export behind
// the address (Verify refuses it), nothing is replayed onto it: the write in flight and
// every call after fail with ErrExportChanged, and the other export is untouched.
func TestVerifyStopsOnOtherExport(t *testing.T) {
	t.Parallel()
	p, uri, _ := behindProxy(t)
	mark := bytes.Repeat([]byte{0xe1}, 512)
	verify := func(read func([]byte, int64) error) error {
		b := make([]byte, 512)
		if err := read(b, 0); err != nil {
			return err
		}
		if !bytes.Equal(b, mark) {
			return errors.New("the first sector is not this export's")
		}
		return nil
	}
	r := open(t, uri, &Options{RequestTimeout: 200 * time.Millisecond, QueueTimeout: 30 * time.Second,
		BackoffMax: 50 * time.Millisecond, Verify: verify})
	if _, err := r.WriteAt(mark, 0); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{7}, 4096)
	if _, err := r.WriteAt(data, 4096); err != nil { // acknowledged, not flushed: in the replay log
		t.Fatal(err)
	}
	otherImg := image(t, 8<<20)
	other := nbdkit(t, "unix", nil, "file", otherImg)
	p.SetUpstream("unix", other.addr)
	p.Cut()
	if err := r.Sync(); !errors.Is(err, ErrExportChanged) {
		t.Fatalf("flush after the export changed: %v, want ErrExportChanged", err)
	}
	if _, err := r.WriteAt(data, 8192); !errors.Is(err, ErrExportChanged) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("write after the export changed: %v, want ErrExportChanged", err)
	}
	if h := r.Health(); h.Broken == nil || h.Connected {
		t.Fatalf("health after the export changed: %+v", h)
	}
	b, err := os.ReadFile(otherImg)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, make([]byte, len(b))) {
		t.Fatal("writes reached the other export")
	}
}

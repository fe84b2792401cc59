package volume

import (
	"crypto/rand"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func TestIDLock(t *testing.T) {
	var a, b [16]byte
	rand.Read(a[:])
	rand.Read(b[:])
	l, err := lockVolumeID(a)
	if err != nil {
		t.Fatal(err)
	}
	_, err = lockVolumeID(a)
	if !errors.Is(err, ErrIDLocked) {
		t.Fatalf("second lock of one ID: %v, want ErrIDLocked", err)
	}
	// The error names the holder, found through /proc: here, this process.
	var held *IDHeldError
	if !errors.As(err, &held) || held.PID != os.Getpid() {
		t.Fatalf("second lock of one ID: %v; want it to name pid %d", err, os.Getpid())
	}
	lb, err := lockVolumeID(b)
	if err != nil {
		t.Fatalf("lock of another ID: %v", err)
	}
	lb.Close()

	// A descriptor handed on (as to the background server) is the lock: it holds while
	// any copy of it is open.
	adopted := adoptIDLock(os.NewFile(uintptr(dup(t, l.File())), "inherited"), a)
	if adopted == nil {
		t.Fatal("adoptIDLock does not recognize a lock")
	}
	l.Close()
	if _, err := lockVolumeID(a); !errors.Is(err, ErrIDLocked) {
		t.Fatalf("lock while an inherited copy is open: %v, want ErrIDLocked", err)
	}
	adopted.Close()
	again, err := lockVolumeID(a)
	if err != nil {
		t.Fatalf("lock after every holder closed: %v", err)
	}
	again.Close()

	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	if adoptIDLock(f, a) != nil {
		t.Fatal("adoptIDLock takes /dev/null for a lock")
	}
}

func dup(t *testing.T, f *os.File) int {
	t.Helper()
	sc, err := f.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	var derr error
	sc.Control(func(s uintptr) { fd, derr = unix.Dup(int(s)) })
	if derr != nil {
		t.Fatal(derr)
	}
	return fd
}

// TestIDLockShared: readers share a volume ID and exclude a writer, who excludes them;
// a writer's refusal says whether the holder serves the volume.
func TestIDLockShared(t *testing.T) {
	var id [16]byte
	rand.Read(id[:])
	r1, err := lockVolumeIDShared(id)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := lockVolumeIDShared(id)
	if err != nil {
		t.Fatalf("a second reader: %v", err)
	}
	var held *IDHeldError
	if _, err := lockVolumeID(id); !errors.As(err, &held) || !held.ReadOnly || !held.Serving {
		t.Fatalf("a writer beside readers: %v, want an IDHeldError naming read-only holders", err)
	}
	r1.Close()
	r2.Close()
	w, err := lockVolumeID(id)
	if err != nil {
		t.Fatalf("a writer once the readers are gone: %v", err)
	}
	if _, err := lockVolumeIDShared(id); !errors.As(err, &held) || held.ReadOnly || held.Serving {
		t.Fatalf("a reader beside a writer at work: %v, want an IDHeldError, not serving", err)
	}
	if err := w.MarkServing(); err != nil {
		t.Fatal(err)
	}
	if _, err := lockVolumeID(id); !errors.As(err, &held) || !held.Serving {
		t.Fatalf("a writer beside a server: %v, want it named as serving", err)
	}
	// An inherited reader's hold stays a reader's.
	r3, err := lockVolumeIDShared(id)
	if err == nil {
		t.Fatal("a reader beside a writer")
	}
	w.Close()
	if r3, err = lockVolumeIDShared(id); err != nil {
		t.Fatal(err)
	}
	adopted := adoptIDLock(os.NewFile(uintptr(dup(t, r3.File())), "inherited"), id)
	r3.Close()
	if adopted == nil || !adopted.Shared() {
		t.Fatalf("adopted reader's hold: %+v", adopted)
	}
	if _, err := lockVolumeID(id); err == nil {
		t.Fatal("a writer beside an inherited reader")
	}
	adopted.Close()
	if w, err = lockVolumeID(id); err != nil {
		t.Fatal(err)
	}
	w.Close()
}

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
	l, err := LockID(a)
	if err != nil {
		t.Fatal(err)
	}
	_, err = LockID(a)
	if !errors.Is(err, ErrIDLocked) {
		t.Fatalf("second lock of one ID: %v, want ErrIDLocked", err)
	}
	// The error names the holder, found through /proc: here, this process.
	var held *IDHeldError
	if !errors.As(err, &held) || held.PID != os.Getpid() {
		t.Fatalf("second lock of one ID: %v; want it to name pid %d", err, os.Getpid())
	}
	lb, err := LockID(b)
	if err != nil {
		t.Fatalf("lock of another ID: %v", err)
	}
	lb.Close()

	// A descriptor handed on (as to the background server) is the lock: it holds while
	// any copy of it is open.
	adopted := IDLockFromFile(os.NewFile(uintptr(dup(t, l.File())), "inherited"))
	if adopted == nil {
		t.Fatal("IDLockFromFile does not recognize a lock")
	}
	l.Close()
	if _, err := LockID(a); !errors.Is(err, ErrIDLocked) {
		t.Fatalf("lock while an inherited copy is open: %v, want ErrIDLocked", err)
	}
	adopted.Close()
	again, err := LockID(a)
	if err != nil {
		t.Fatalf("lock after every holder closed: %v", err)
	}
	again.Close()

	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	if IDLockFromFile(f) != nil {
		t.Fatal("IDLockFromFile takes /dev/null for a lock")
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

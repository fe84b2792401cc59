// Package wipe zeroes key material that other packages hold and offer no way to clear.
package wipe

import (
	"crypto/cipher"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// AEADKey zeroes the key inside an x/crypto chacha20poly1305 AEAD (ChaCha20-Poly1305 or
// XChaCha20-Poly1305). That package keeps the key in its only field, key [32]byte, and
// has no method to clear it, so this reaches it by reflection. It reports whether the
// field was found; the tests fail if an x/crypto upgrade moves it, so that a silent
// no-op cannot ship.
func AEADKey(a cipher.AEAD) bool {
	v := reflect.ValueOf(a)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		return false
	}
	f := v.Elem().FieldByName("key")
	if !f.IsValid() || f.Kind() != reflect.Array || f.Type().Elem().Kind() != reflect.Uint8 {
		return false
	}
	clear(unsafe.Slice((*byte)(unsafe.Pointer(f.UnsafeAddr())), f.Len()))
	return true
}

// StackBytes is how much of the stack below its caller Stack zeroes: more than any call
// that holds a key on the stack uses (internal/chacha: TestKeyedCallsFitTheStackWipe).
const StackBytes = 6 << 10

// Stack zeroes StackBytes of the goroutine's stack below its caller's frame. Called
// before a call that puts key material on the stack, it makes the stack grow, if it
// must, while nothing secret is on it: growing copies the stack and frees the old one
// without zeroing it, and the old one would keep the key where no wipe reaches. Called
// after, it overwrites what the call left below the stack pointer, which a later growth
// or the collector's shrinking would otherwise copy or free as it is.
//
//go:noinline
func Stack() {
	var b [StackBytes]byte
	keep(&b)
}

// keep makes the compiler zero b and keep it on the stack (its address does not escape).
//
//go:noinline
func keep(b *[StackBytes]byte) {}

// SignalFrames overwrites what the kernel saved of this process's registers when a
// signal last interrupted each of its threads: a signal frame holds the vector
// registers, and AES code keeps round keys there (the first two of AES-256 are the key's
// first half). The frames stay on each thread's signal stack until the next signal writes
// over them at the same place, so this sends every thread the Go runtime's preemption
// signal, SIGURG, which the runtime takes in its stride, and waits until each has been
// delivered. Call it once the keys are wiped and nothing runs that holds them.
func SignalFrames() error {
	pid := unix.Getpid()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return err
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		// A thread that has exited meanwhile has no frame left to overwrite.
		if err := unix.Tgkill(pid, tid, unix.SIGURG); err != nil && err != unix.ESRCH {
			return err
		}
	}
	// Delivery is asynchronous: wait until no thread has SIGURG pending.
	for range 100 {
		if !sigurgPending(pid) {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}

// sigurgPending reports whether some thread of pid still has SIGURG pending.
func sigurgPending(pid int) bool {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return false
	}
	bit := uint64(1) << (uint(unix.SIGURG) - 1)
	for _, t := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + t.Name() + "/status")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "SigPnd:"); ok {
				if m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err == nil && m&bit != 0 {
					return true
				}
			}
		}
	}
	return false
}

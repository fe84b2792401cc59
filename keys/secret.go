package keys

import (
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Secret holds key material outside the Go heap: in its own anonymous mapping, locked
// into RAM (mlock) where the OS allows and excluded from core dumps (MADV_DONTDUMP). The
// garbage collector never copies it, so Wipe really removes the only copy.
//
// A Secret never prints its contents: fmt (any verb), slog and %#v all give "[redacted]".
// A Secret is a handle: copies of the struct share one buffer, so a Wipe through any of
// them wipes it for all. It is not safe for concurrent Wipe and use.
//
// There is deliberately no finalizer: Bytes hands out a slice of the mapping, and
// unmapping it behind a caller who still holds that slice would crash the process. A
// Secret dropped without Wipe stays (locked) in memory until the process exits.
type Secret struct {
	s *secret
}

type secret struct {
	b      []byte
	region region
}

// region is a Secret's backing mapping.
type region struct {
	mem    []byte // whole mapping, as unix.Mmap returned it; nil for a heap fallback
	locked bool
}

func (r region) zero() { clear(r.mem) }

func (r region) release() {
	r.zero()
	if r.locked {
		_ = unix.Munlock(r.mem)
	}
	if r.mem != nil {
		_ = unix.Munmap(r.mem)
	}
}

var (
	lockErrOnce sync.Once
	lockErr     error
	// liveMappings counts Secrets mapped and not yet wiped, so tests can see leaks.
	liveMappings atomic.Int64
)

// recordLockFailure keeps the first reason key material could not be locked in memory;
// the process goes on (mlock is defence in depth, not a precondition).
func recordLockFailure(err error) {
	lockErrOnce.Do(func() { lockErr = err })
}

// MemoryLockError reports the first failure to lock key material into RAM (typically
// RLIMIT_MEMLOCK), or nil if every Secret so far is locked. A CLI can print it once as a
// warning: such keys may reach swap.
func MemoryLockError() error {
	lockErrOnce.Do(func() {})
	return lockErr
}

// NewSecret returns a zeroed Secret of n bytes.
func NewSecret(n int) *Secret {
	s := &secret{}
	if n <= 0 {
		s.b = []byte{}
		return &Secret{s}
	}
	page := os.Getpagesize()
	size := (n + page - 1) / page * page
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		recordLockFailure(fmt.Errorf("map %d bytes for key material: %w", size, err))
		s.b = make([]byte, n)
		return &Secret{s}
	}
	_ = unix.Madvise(mem, unix.MADV_DONTDUMP)
	r := region{mem: mem}
	if err := unix.Mlock(mem); err != nil {
		recordLockFailure(fmt.Errorf("lock key material in memory (raise RLIMIT_MEMLOCK?): %w", err))
	} else {
		r.locked = true
	}
	s.region = r
	s.b = mem[:n:n]
	liveMappings.Add(1)
	return &Secret{s}
}

// secretFrom returns a Secret holding a copy of b.
func secretFrom(b []byte) *Secret {
	s := NewSecret(len(b))
	copy(s.Bytes(), b)
	return s
}

// Bytes is the key material itself. The slice is valid until Wipe; do not keep it, or any
// copy of it, beyond the Secret's life.
func (s *Secret) Bytes() []byte {
	if s == nil || s.s == nil {
		return nil
	}
	return s.s.b
}

// Len is the number of bytes held (0 after Wipe).
func (s *Secret) Len() int { return len(s.Bytes()) }

// Locked reports whether the Secret's memory is locked into RAM.
func (s *Secret) Locked() bool { return s != nil && s.s != nil && s.s.region.locked }

// Wipe zeroes the key material and releases its memory. It is idempotent.
func (s *Secret) Wipe() {
	if s == nil || s.s == nil {
		return
	}
	s.s.wipe()
}

func (s *secret) wipe() {
	clear(s.b)
	if s.region.mem != nil {
		liveMappings.Add(-1)
	}
	s.region.release()
	s.region = region{}
	s.b = nil
}

const redacted = "[redacted]"

// The formatting methods have value receivers so that a Secret value, not only a pointer,
// prints as redacted; a struct that holds a *Secret prints its address, never its bytes.

func (Secret) String() string             { return redacted }
func (Secret) GoString() string           { return redacted }
func (Secret) Format(f fmt.State, _ rune) { _, _ = f.Write([]byte(redacted)) }
func (Secret) LogValue() slog.Value       { return slog.StringValue(redacted) }

package nbd

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
)

// memBackend is an in-memory Backend that records what it was asked to do.
type memBackend struct {
	mu      sync.RWMutex
	data    []byte
	ops     []op // every write-type call and flush, in order
	flushes atomic.Int64
	// hook, if set, runs before every call; a non-nil error fails the call.
	hook func(name string, off, n int64, f Flags) error
	// noZero makes WriteZeroes fail with ENOTSUP, as a backend that cannot zero would.
	noZero bool
	// noTrim makes Trim fail with ENOTSUP.
	noTrim bool
}

type op struct {
	name   string
	off, n int64
	flags  Flags
}

func newMem(size int) *memBackend { return &memBackend{data: make([]byte, size)} }

func (m *memBackend) Size() int64 { return int64(len(m.data)) }

func (m *memBackend) call(name string, off, n int64, f Flags) error {
	if off < 0 || n < 0 || off+n > int64(len(m.data)) {
		// The server promises to check bounds; a backend seeing this is a server bug.
		panic(fmt.Sprintf("%s out of bounds: off %d len %d size %d", name, off, n, len(m.data)))
	}
	if m.hook != nil {
		return m.hook(name, off, n, f)
	}
	return nil
}

func (m *memBackend) record(name string, off, n int64, f Flags) {
	m.ops = append(m.ops, op{name, off, n, f})
}

func (m *memBackend) ReadAt(p []byte, off int64) error {
	if err := m.call("read", off, int64(len(p)), 0); err != nil {
		return err
	}
	m.mu.RLock()
	copy(p, m.data[off:])
	m.mu.RUnlock()
	return nil
}

func (m *memBackend) WriteAt(p []byte, off int64, f Flags) error {
	if err := m.call("write", off, int64(len(p)), f); err != nil {
		return err
	}
	m.mu.Lock()
	copy(m.data[off:], p)
	m.record("write", off, int64(len(p)), f)
	m.mu.Unlock()
	return nil
}

func (m *memBackend) WriteZeroes(off, n int64, f Flags) error {
	if err := m.call("zero", off, n, f); err != nil {
		return err
	}
	if m.noZero {
		return fmt.Errorf("mem: cannot zero: %w", syscall.ENOTSUP)
	}
	m.mu.Lock()
	clear(m.data[off : off+n])
	m.record("zero", off, n, f)
	m.mu.Unlock()
	return nil
}

func (m *memBackend) Trim(off, n int64, f Flags) error {
	if err := m.call("trim", off, n, f); err != nil {
		return err
	}
	if m.noTrim {
		return fmt.Errorf("mem: cannot trim: %w", syscall.ENOTSUP)
	}
	m.mu.Lock()
	clear(m.data[off : off+n])
	m.record("trim", off, n, f)
	m.mu.Unlock()
	return nil
}

func (m *memBackend) Flush() error {
	if err := m.call("flush", 0, 0, 0); err != nil {
		return err
	}
	m.flushes.Add(1)
	m.mu.Lock()
	m.record("flush", 0, 0, 0)
	m.mu.Unlock()
	return nil
}

func (m *memBackend) snapshot() []byte {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return append([]byte(nil), m.data...)
}

func (m *memBackend) opsCopy() []op {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return append([]op(nil), m.ops...)
}

func (m *memBackend) fill(seed byte) {
	m.mu.Lock()
	for i := range m.data {
		m.data[i] = byte(i*7) ^ seed
	}
	m.mu.Unlock()
}

// blockReadAt0 makes every read of mem at offset 0 wait until the returned channel is
// closed: a slow request, for tests of what must not wait for it.
func blockReadAt0(mem *memBackend) chan struct{} {
	release := make(chan struct{})
	mem.hook = func(name string, off, n int64, f Flags) error {
		if name == "read" && off == 0 {
			<-release
		}
		return nil
	}
	return release
}

// failRange returns a hook that fails calls named name touching [from, to) with err.
func failRange(name string, from, to int64, err error) func(string, int64, int64, Flags) error {
	return func(n string, off, length int64, _ Flags) error {
		if n == name && off < to && off+length > from {
			return err
		}
		return nil
	}
}

package volume

import (
	"sync"
	"sync/atomic"
	"time"
)

// counters count a volume's requests, for Status.
type counters struct {
	reads, writes, zeroes, trims, flushes, caches atomic.Uint64
	bytesRead, bytesWritten                       atomic.Uint64
}

func (c *counters) fill(s *Status) {
	s.Reads, s.Writes, s.WriteZeroes = c.reads.Load(), c.writes.Load(), c.zeroes.Load()
	s.Trims, s.Flushes, s.Caches = c.trims.Load(), c.flushes.Load(), c.caches.Load()
	s.BytesRead, s.BytesWritten = c.bytesRead.Load(), c.bytesWritten.Load()
}

// faults keeps what went wrong under a volume: the last error of any request, and the
// first failure of the provider under a write or flush, which fails the volume for good
// (in the authenticated modes the device accepts no more writes after one).
type faults struct {
	mu       sync.Mutex
	failed   error // sticky
	lastErr  error
	lastTime time.Time
	changed  chan struct{} // kicked when failed is first set
}

func newFaults() faults { return faults{changed: make(chan struct{}, 1)} }

// last records err as the last error.
func (f *faults) last(err error) {
	f.mu.Lock()
	f.lastErr, f.lastTime = err, time.Now()
	f.mu.Unlock()
}

// fail records err as the last error and, if the volume has not failed yet, as the
// failure that stops it.
func (f *faults) fail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastErr, f.lastTime = err, time.Now()
	if f.failed == nil {
		f.failed = err
		select {
		case f.changed <- struct{}{}:
		default:
		}
	}
}

// err is the failure that stopped the volume, or nil.
func (f *faults) err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed
}

// fill puts the failure and the last error in s: a failed volume's State is failed.
func (f *faults) fill(s *Status) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed != nil {
		s.State, s.Error = StateFailed, f.failed.Error()
	}
	if f.lastErr != nil {
		s.LastError, s.LastErrorAt = f.lastErr.Error(), f.lastTime
	}
}

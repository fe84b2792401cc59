package nbdclient

import (
	"fmt"
	"sync"
	"time"
)

// What holds a call back, and for how long: room in flight (flight), the call's own
// bound (waiter) and the one SetDeadline puts on every call (deadline).

// flight bounds the bytes of requests on the wire at once (Options.MaxInFlight). It has
// a lock of its own, so that a call waits for room without holding the Remote's.
type flight struct {
	max  int64
	mu   sync.Mutex
	cond *sync.Cond
	used int64
}

func (f *flight) init(max int64) {
	f.max = max
	f.cond = sync.NewCond(&f.mu)
}

// acquire waits for n bytes of room, for as long as w allows.
func (f *flight) acquire(n int64, w waiter) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.used+n <= f.max {
		f.used += n
		return nil
	}
	// Wake on every release, once at the deadline, and when the call is canceled (the
	// SetDeadline timer wakes us itself).
	if !w.deadline.IsZero() {
		t := time.AfterFunc(time.Until(w.deadline), f.wake)
		defer t.Stop()
	}
	if w.cancel != nil {
		stop := make(chan struct{})
		defer close(stop)
		go func() {
			select {
			case <-w.cancel:
				f.wake()
			case <-stop:
			}
		}()
	}
	for f.used+n > f.max {
		if err := w.expired(); err != nil {
			return fmt.Errorf("nbd: waiting for room in flight: %w", err)
		}
		f.cond.Wait()
	}
	f.used += n
	return nil
}

// release gives back n bytes of room.
func (f *flight) release(n int64) {
	f.mu.Lock()
	f.used -= n
	f.cond.Broadcast()
	f.mu.Unlock()
}

// wake has the calls waiting for room check their waiters again.
func (f *flight) wake() {
	f.mu.Lock()
	f.cond.Broadcast()
	f.mu.Unlock()
}

// waiter is what bounds one call's waits: its own deadline (zero: none), the Remote's
// SetDeadline, and its caller's cancellation (nil: none).
type waiter struct {
	deadline time.Time
	expire   <-chan struct{}
	cancel   <-chan struct{}
}

// expired reports why the call must stop waiting, or nil.
func (w waiter) expired() error {
	select {
	case <-w.expire:
		return ErrDeadline
	case <-w.cancel:
		return eio("nbd: call canceled")
	default:
	}
	if !w.deadline.IsZero() && !time.Now().Before(w.deadline) {
		return eio("nbd: timed out")
	}
	return nil
}

// timer fires at the call's deadline; its channel is nil (never ready) without one.
func (w waiter) timer() (<-chan time.Time, func()) {
	if w.deadline.IsZero() {
		return nil, func() {}
	}
	t := time.NewTimer(time.Until(w.deadline))
	return t.C, func() { t.Stop() }
}

// deadline is the bound SetDeadline puts on every call: a channel closed once it has
// passed.
type deadline struct {
	mu    sync.Mutex
	ch    chan struct{}
	timer *time.Timer
}

func (d *deadline) init() { d.ch = make(chan struct{}) }

// set moves the deadline to t (the zero time removes it); passed runs once it has
// passed, after the channel is closed.
func (d *deadline) set(t time.Time, passed func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	select {
	case <-d.ch:
		d.ch = make(chan struct{}) // passed before: a new one
	default:
	}
	if t.IsZero() {
		return
	}
	ch := d.ch
	d.timer = time.AfterFunc(time.Until(t), func() {
		close(ch)
		passed()
	})
}

// expiry is the channel closed once the deadline has passed.
func (d *deadline) expiry() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ch
}

// SetDeadline bounds every call, in progress or to come, by t: from t on they fail with
// ErrDeadline (an EIO) instead of waiting for the server, whatever QueueTimeout says.
// It is for a caller that must stop within a bound (a server shutting down). A later
// call moves the deadline; the zero time removes it.
func (r *Remote) SetDeadline(t time.Time) {
	// Wake the calls that wait for room in flight.
	r.deadline.set(t, r.flight.wake)
}

package blockdev

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elidisk/eli/sector"
)

// Suspend and resume (geli's suspend and resume): the device finishes what is in flight,
// makes every write durable, wipes every key it holds, and then holds new requests (they
// wait, they do not fail) until Resume gives it the keys again. A request is held where
// it enters the device (enterGate), before it touches anything that needs a key, and the
// held are let in by Resume in the order they arrived.

// Errors of suspend and resume.
var (
	// ErrSuspended: Suspend of a device that is suspended already, or an operation that
	// cannot wait for a resume.
	ErrSuspended = errors.New("the device is suspended")
	// ErrNotSuspended: Resume of a device that is not suspended.
	ErrNotSuspended = errors.New("the device is not suspended")
)

// Keys are what a suspended device resumes with: the same keys Open was given (Config's
// Codec, JournalKey and Reencrypt), derived again from the master key. Resume copies the
// journal keys; the codecs become the caller's, as Open's are.
type Keys struct {
	Codec      sector.Codec
	JournalKey []byte
	// Reencrypt holds the previous key's codec and journal key when the device was
	// suspended halfway through a re-encryption; its Epoch and Cursor are not used (the
	// device kept where its sweep stands).
	Reencrypt *Reencrypt
}

// suspension is what a suspended device remembers of the keys it wiped, to check the
// keys it resumes with.
type suspension struct {
	since    time.Time
	mode     sector.Mode
	prev     bool // a re-encryption was under way: Resume needs its previous key too
	prevMode sector.Mode
}

// hold is where requests wait while the device is suspended: in a queue, in the order
// they arrived. on is read without the lock on every request (one atomic load when the
// device is not suspended).
type hold struct {
	on    atomic.Bool
	mu    sync.Mutex
	queue []*holdWaiter
}

// holdWaiter is one held request: Resume closes wake, and the request closes in once it
// has entered the gate, so that the next is woken only then.
type holdWaiter struct{ wake, in chan struct{} }

// wait returns at once (nil) unless requests are held; otherwise it queues the caller
// and returns once the caller's turn has come. The caller calls entered on what it gets
// once it holds the gate.
func (h *hold) wait() *holdWaiter {
	if !h.on.Load() {
		return nil
	}
	h.mu.Lock()
	if !h.on.Load() {
		h.mu.Unlock()
		return nil
	}
	w := &holdWaiter{wake: make(chan struct{}), in: make(chan struct{})}
	h.queue = append(h.queue, w)
	h.mu.Unlock()
	<-w.wake
	return w
}

func (w *holdWaiter) entered() {
	if w != nil {
		close(w.in)
	}
}

// start holds every request that comes from now on.
func (h *hold) start() {
	h.mu.Lock()
	h.on.Store(true)
	h.mu.Unlock()
}

// release lets the held requests go, one at a time in the order they came, each once the
// one before it has entered the gate; requests that arrive meanwhile queue behind them.
// It returns once the queue is empty and requests pass freely again. The gate must be
// free of a writer that waits for requests in flight: a woken request could not enter.
func (h *hold) release() {
	for {
		h.mu.Lock()
		if len(h.queue) == 0 {
			h.on.Store(false)
			h.mu.Unlock()
			return
		}
		w := h.queue[0]
		h.queue[0] = nil
		h.queue = h.queue[1:]
		h.mu.Unlock()
		close(w.wake)
		<-w.in
	}
}

// releaseAll lets every held request go at once: after a suspend that failed, when the
// gate may still wait for requests in flight, and at Close, where they all fail.
func (h *hold) releaseAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.on.Store(false)
	for _, w := range h.queue {
		close(w.wake)
	}
	h.queue = nil
}

// held is the number of requests waiting.
func (h *hold) held() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.queue)
}

// Suspend finishes the requests in flight, commits and flushes every write (in the
// authenticated modes it also leaves an empty journal, as Close does, so that a server
// killed while suspended leaves nothing to recover), holds a re-encryption's sweep
// (Sweeper) between steps until Resume and records its checkpoint
// (SweeperConfig.Checkpoint), and wipes every key the device holds: the codecs of the
// current and, during a re-encryption, the previous key (which are the caller's, but
// wiped here all the same: a suspended device must hold no key) and its journal keys.
// Requests that come meanwhile are held until Resume, or fail with ErrClosed if the
// device is closed instead.
//
// If ctx ends before the requests in flight finish, or the sweep's step, or the
// checkpoint or the commit fails, Suspend returns the error and the device goes on
// serving with its keys. The commit's failure
// is the provider's, which has then failed the device's writes.
func (d *Device) Suspend(ctx context.Context) error {
	d.susMu.Lock()
	defer d.susMu.Unlock()
	d.gate.RLock()
	closed, suspended := d.closed, d.susp != nil
	d.gate.RUnlock()
	switch {
	case closed:
		return ErrClosed
	case suspended:
		return ErrSuspended
	}
	sw := d.sweeper.Load()
	if sw != nil {
		if err := sw.hold(ctx); err != nil {
			return fmt.Errorf("suspend: the re-encryption's sweep did not pause: %w", err)
		}
		// Where the sweep stands goes to the header now, while the caller still has the
		// key that writes it: a server stopped while suspended then leaves a volume that
		// resumes from here, and the sweep stopped meanwhile has nothing to record.
		if err := sw.Checkpoint(); err != nil {
			sw.unhold()
			return fmt.Errorf("suspend: %w", err)
		}
	}
	undo := func() {
		d.hold.releaseAll()
		if sw != nil {
			sw.unhold()
		}
	}
	d.hold.start()
	if err := d.lockWithin(ctx); err != nil {
		undo()
		return fmt.Errorf("suspend: requests in flight did not finish: %w", err)
	}
	if err := d.eng.suspend(); err != nil {
		d.gate.Unlock()
		undo()
		return fmt.Errorf("suspend: %w", err)
	}
	s := &suspension{since: time.Now(), mode: d.keys.cur.codec.Mode()}
	if p := d.keys.prev; p != nil {
		s.prev, s.prevMode = true, p.codec.Mode()
	}
	d.eng.withKeys(d.keys.wipe)
	d.susp = s
	d.gate.Unlock()
	return nil
}

// lockWithin takes the gate exclusively, or fails when ctx ends first. It tries rather
// than waits: a Lock left waiting after ctx ended would hold back every new request
// (readers queue behind a waiting writer) until the requests in flight ended, which is
// just what a suspend that gave up must not do. New requests are held meanwhile
// (hold.start), so only those in flight keep the gate shared, and they end.
func (d *Device) lockWithin(ctx context.Context) error {
	wait := 50 * time.Microsecond
	for !d.gate.TryLock() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Millisecond)
	}
	return nil
}

// Resume installs k, which must be the keys the device was suspended with (the mode it
// had, and the previous key too if a re-encryption was under way), lets the held
// requests in, in the order they came, and lets a paused sweep go on. On an error the
// device stays suspended and k stays the caller's.
//
// Resume cannot tell a wrong key of the right mode from the right one: the caller checks
// k against the volume's header first.
func (d *Device) Resume(k Keys) error {
	d.susMu.Lock()
	defer d.susMu.Unlock()
	d.gate.Lock()
	if d.closed {
		d.gate.Unlock()
		return ErrClosed
	}
	s := d.susp
	if s == nil {
		d.gate.Unlock()
		return ErrNotSuspended
	}
	cur, prev, err := d.resumeKeys(s, k)
	if err != nil {
		d.gate.Unlock()
		return fmt.Errorf("resume: %w", err)
	}
	d.eng.withKeys(func() {
		d.keys.cur = cur
		if prev != nil {
			d.keys.prev = prev
		}
	})
	d.susp = nil
	d.gate.Unlock()
	d.hold.release()
	if sw := d.sweeper.Load(); sw != nil {
		sw.unhold()
	}
	return nil
}

// resumeKeys checks k against what the device was suspended with and makes its key sets.
func (d *Device) resumeKeys(s *suspension, k Keys) (keySet, *keySet, error) {
	c := k.Codec
	if c == nil {
		return keySet{}, nil, errors.New("no codec")
	}
	if c.Mode() != s.mode || c.SectorSize() != d.s || c.MetaSize() != d.l.MetaSize() {
		return keySet{}, nil, fmt.Errorf("the device was suspended with %s and %d-byte sectors, not %s and %d-byte sectors",
			s.mode, d.s, c.Mode(), c.SectorSize())
	}
	if s.prev != (k.Reencrypt != nil) {
		if s.prev {
			return keySet{}, nil, errors.New("a re-encryption is under way: its previous key is needed too")
		}
		return keySet{}, nil, errors.New("a previous key was given, but no re-encryption is under way")
	}
	cur, err := newKeySet(c)
	if err != nil {
		return keySet{}, nil, err
	}
	if d.l.Authenticated() {
		if err := cur.setJournalKey(k.JournalKey); err != nil {
			return keySet{}, nil, err
		}
	}
	if !s.prev {
		return cur, nil, nil
	}
	if m := k.Reencrypt.Prev; m != nil && m.Mode() != s.prevMode {
		cur.wipeJournal()
		return keySet{}, nil, fmt.Errorf("the previous key was %s, not %s", s.prevMode, m.Mode())
	}
	prev, err := prevKeySet(d.l, c, *k.Reencrypt)
	if err != nil {
		cur.wipeJournal()
		return keySet{}, nil, err
	}
	return cur, &prev, nil
}

// Suspended reports whether the device is suspended, and since when.
func (d *Device) Suspended() (bool, time.Time) {
	d.gate.RLock()
	defer d.gate.RUnlock()
	if d.susp == nil {
		return false, time.Time{}
	}
	return true, d.susp.since
}

// Held is the number of requests waiting for a Resume.
func (d *Device) Held() int { return d.hold.held() }

// wipe overwrites every key of the keyring and leaves sets that hold nothing: a use of
// one before Resume is a nil dereference, never a seal under a zeroed key. The previous
// set stays (empty) so that the device still says a re-encryption is under way.
func (k *keyring) wipe() {
	k.cur.wipe()
	if k.prev != nil {
		k.prev.wipe()
	}
}

func (k *keySet) wipe() {
	if k.codec != nil {
		k.codec.Wipe()
	}
	k.wipeJournal()
	*k = keySet{}
}

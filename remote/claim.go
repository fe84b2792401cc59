package remote

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"
)

// DefaultInterval is the heartbeat interval (Options.Interval). An attach that finds
// another instance's mark waits 3 intervals (its own or the mark's, whichever is
// longer) before deciding.
const DefaultInterval = 2 * time.Second

// HeldError: another instance heartbeats the volume (or wrote its mark since, which
// now does not decode: Unreadable says how).
type HeldError struct {
	Name       string
	Host       string
	Instance   string
	Unreadable string
}

func (e *HeldError) Error() string {
	if e.Unreadable != "" {
		return fmt.Sprintf("the ownership mark of %s changed and is unreadable now (%s): another instance may be writing the volume", e.Name, e.Unreadable)
	}
	return fmt.Sprintf("%s is attached read-write by host %q (instance %s), whose heartbeat is moving", e.Name, e.Host, e.Instance)
}

// ClaimOptions say how Claim deals with a mark held by another instance.
type ClaimOptions struct {
	Force bool // take over a live owner
	// Notify hears what Claim waits for and what it takes over (warnings for the user).
	Notify func(string)
}

// Claim makes this Store the volume's owner and starts its heartbeat. An empty or
// released mark is taken at once. One held by another instance is taken at once with
// Force; otherwise Claim waits three heartbeat intervals and reads it again: a mark
// that moved is refused (*HeldError), one that did not is taken over. After a
// takeover it waits one more interval and checks that the mark is still its own, so
// that a heartbeat written at the moment of the takeover does not leave two owners.
func (s *Store) Claim(o ClaimOptions) error {
	notify := o.Notify
	if notify == nil {
		notify = func(string) {}
	}
	iv := s.interval
	first, err := s.readMark()
	if err != nil && !errors.Is(err, errBadMark) {
		return fmt.Errorf("read the ownership mark of %s: %w", s.name, err)
	}
	bad := err != nil
	takeover := false
	if bad || first.State == Held {
		takeover = true
		who := fmt.Sprintf("host %q (instance %s)", first.Host, first.InstanceString())
		if bad {
			who = "an unreadable mark (" + err.Error() + ")"
		}
		wait := 3 * max(iv, first.Interval)
		switch {
		case o.Force:
			notify(fmt.Sprintf("%s: taking it over from %s; that server stops writing at its next heartbeat", s.name, who))
		default:
			notify(fmt.Sprintf("%s is marked as attached by %s: waiting %v to see whether its heartbeat moves", s.name, who, wait))
			time.Sleep(wait)
			again, err := s.readMark()
			if err != nil && !errors.Is(err, errBadMark) {
				return fmt.Errorf("read the ownership mark of %s: %w", s.name, err)
			}
			switch {
			case err == nil && (again.State == Empty || again.State == Released):
				takeover = false // released meanwhile: a clean claim
			case err == nil && (again.Counter != first.Counter || again.Instance != first.Instance || bad):
				return &HeldError{Name: s.name, Host: again.Host, Instance: again.InstanceString()}
			case err != nil && !bad:
				return &HeldError{Name: s.name, Unreadable: fmt.Sprintf("it was %s's: %v", who, err)}
			default:
				notify(fmt.Sprintf("%s: the heartbeat of %s did not move in %v: taking the volume over", s.name, who, wait))
			}
		}
	}
	m := Mark{State: Held, Interval: iv, Host: hostname(), Time: time.Now(), Counter: 1}
	if _, err := rand.Read(m.Instance[:]); err != nil {
		return err
	}
	if err := s.writeMark(m); err != nil {
		return fmt.Errorf("write the ownership mark of %s: %w", s.name, err)
	}
	if takeover {
		time.Sleep(max(iv, first.Interval) + iv/2)
		cur, err := s.readMark()
		if err != nil {
			return fmt.Errorf("read back the ownership mark of %s: %w", s.name, err)
		}
		if cur.State != Held || cur.Instance != m.Instance {
			return &HeldError{Name: s.name, Host: cur.Host, Instance: cur.InstanceString()}
		}
		m.Counter = cur.Counter
	}
	s.start(m)
	return nil
}

// Probe checks, without claiming, that no other instance writes the volume: what a
// read-only user needs, which writes no mark. A mark held by another instance is read
// again after three heartbeat intervals, as Claim does: one that moved is refused
// (*HeldError); one that did not belongs to an owner that is gone.
func (s *Store) Probe(o ClaimOptions) error {
	notify := o.Notify
	if notify == nil {
		notify = func(string) {}
	}
	first, err := s.readMark()
	if err != nil && !errors.Is(err, errBadMark) {
		return fmt.Errorf("read the ownership mark of %s: %w", s.name, err)
	}
	if err != nil || first.State != Held {
		return nil
	}
	wait := 3 * max(s.interval, first.Interval)
	notify(fmt.Sprintf("%s is marked as attached by host %q (instance %s): waiting %v to see whether its heartbeat moves",
		s.name, first.Host, first.InstanceString(), wait))
	time.Sleep(wait)
	again, err := s.readMark()
	if err != nil && !errors.Is(err, errBadMark) {
		return fmt.Errorf("read the ownership mark of %s: %w", s.name, err)
	}
	if err == nil && again.State == Held && (again.Counter != first.Counter || again.Instance != first.Instance) {
		return &HeldError{Name: s.name, Host: again.Host, Instance: again.InstanceString()}
	}
	return nil
}

// Adopt continues the claim another process made (Handoff): the mark must still be
// held by instance.
func (s *Store) Adopt(instance string) error {
	id, err := hex.DecodeString(instance)
	if err != nil || len(id) != 16 {
		return fmt.Errorf("bad instance ID %q", instance)
	}
	m, err := s.readMark()
	if err != nil {
		return fmt.Errorf("read the ownership mark of %s: %w", s.name, err)
	}
	if m.State != Held || string(m.Instance[:]) != string(id) {
		return fmt.Errorf("%s: the ownership mark is no longer this attach's (now host %q, instance %s)", s.name, m.Host, m.InstanceString())
	}
	s.start(m)
	return nil
}

// Instance is the ID in the mark this Store holds ("" if none).
func (s *Store) Instance() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.owned {
		return ""
	}
	return s.mark.InstanceString()
}

func (s *Store) start(m Mark) {
	s.mu.Lock()
	s.mark, s.owned = m, true
	stop, done := make(chan struct{}), make(chan struct{})
	s.stop, s.done = stop, done
	s.mu.Unlock()
	go s.heartbeat(m.Interval, stop, done)
}

func (s *Store) stopHeartbeat() {
	s.mu.Lock()
	stop, done := s.stop, s.done
	s.stop = nil
	s.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done
	}
}

func (s *Store) heartbeat(iv time.Duration, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(iv)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		if !s.beat() {
			return
		}
	}
}

// beat re-reads the mark and, if it is still this Store's, writes the next count. It
// returns false once fenced. A failed read or write (the storage unreachable) is only
// logged: a host that cannot reach the storage cannot write it either, and the next
// beat that reads the mark decides.
func (s *Store) beat() bool {
	cur, err := s.readMark()
	s.mu.Lock()
	m := s.mark
	s.mu.Unlock()
	if err == nil && (cur.State != Held || cur.Instance != m.Instance) {
		who := fmt.Sprintf("host %q (instance %s)", cur.Host, cur.InstanceString())
		if cur.State != Held {
			who = "a release or a new init"
		}
		s.mu.Lock()
		s.fence = fmt.Errorf("%w: the ownership mark of %s was rewritten by %s", ErrTakenOver, s.name, who)
		s.owned = false
		s.mu.Unlock()
		s.log("ownership lost: %v", s.fence)
		return false
	}
	if err == nil {
		m.Counter, m.Time = max(m.Counter, cur.Counter)+1, time.Now()
		err = s.writeMark(m)
	}
	s.mu.Lock()
	if err != nil {
		s.hbErrs++
	} else {
		s.mark, s.hbErrs = m, 0
	}
	n := s.hbErrs
	s.mu.Unlock()
	if err != nil && (n == 1 || n%100 == 0) {
		s.log("heartbeat failed (%d in a row): %v", n, err)
	}
	return true
}

func (s *Store) log(format string, args ...any) {
	if s.logf != nil {
		s.logf(format, args...)
	}
}

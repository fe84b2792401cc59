// Package remote opens an NBD export (nbdclient.Remote) as an eli provider, and keeps
// the ownership mark that stops two hosts from writing one remote volume at once.
//
// flock reaches only the processes of one host; an NBD export is reachable from many.
// So a Store that writes claims the volume first (Claim): it writes a mark naming its
// host and a random instance ID into the ownership block (mark.go), and then heartbeats
// it, ZFS multihost style: every interval it re-reads the block and, if the mark is
// still its own, increments the counter in it and flushes. A claimant that finds a
// mark held by another instance waits longer than that instance's heartbeat interval
// and reads it again: a counter that moved means a live owner (refused unless forced),
// one that did not means an owner that is gone (taken over, with a warning). An owner
// whose re-read finds another instance's mark has been taken over: it fences itself,
// failing every later write and flush, so the old server stops writing.
//
// The ownership block belongs to the Store alone: writes from above skip it and reads
// see zeroes there, as format version 1 promises for that region.
package remote

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
)

// raw is what a Store does its I/O through: an nbdclient.Remote, or a file in tests.
type raw interface {
	provider.Provider
	Punch(off, length int64) error
	Close() error
}

// Store is a remote provider (provider.Provider and provider.Capable) with the ownership
// block hidden from its users.
type Store struct {
	raw      raw
	remote   *nbdclient.Remote // nil in tests over a file
	name     string
	caps     provider.Capabilities
	interval time.Duration // the heartbeat's, for a claim
	markIO   time.Duration // bound on each read or write of the mark
	ident    []byte        // what identifies the volume at the start of the export (identity)

	mu     sync.Mutex
	fence  error // set once another instance took the volume over: writes fail
	owned  bool  // this Store holds the mark (Claim or Adopt)
	mark   Mark  // the mark as this Store last wrote it
	stop   chan struct{}
	done   chan struct{}
	logf   func(string, ...any)
	hbErrs int // consecutive failed heartbeats, for the log
}

var (
	_ provider.Provider = (*Store)(nil)
	_ provider.Capable  = (*Store)(nil)
)

// IsURI reports whether a PROVIDER argument names a remote export.
func IsURI(s string) bool { return nbdclient.IsURI(s) }

// Canonical is the URI as eli records and shows it: nbdclient's spelling, which holds
// no secret.
func Canonical(uri string) (string, error) {
	t, err := nbdclient.ParseURI(uri)
	if err != nil {
		return "", err
	}
	return t.String(), nil
}

// Options say how Open connects and how a claim heartbeats. The zero value is usable.
type Options struct {
	// Logf, when set, hears of lost connections and of heartbeats that failed.
	Logf func(string, ...any)
	// RequestTimeout and QueueTimeout are nbdclient's (Options): how long a request may
	// go unanswered before its connection is replaced, and how long a call may be held
	// while the storage is away.
	RequestTimeout, QueueTimeout time.Duration
	// Interval is the heartbeat's (DefaultInterval when 0). Tests shorten it, so that
	// takeovers do not wait seconds.
	Interval time.Duration
}

// DefaultRequestTimeout is the request timeout when Options give none.
const DefaultRequestTimeout = 30 * time.Second

// Open connects to the export uri names.
func Open(uri string, o *Options) (*Store, error) {
	if o == nil {
		o = &Options{}
	}
	s := &Store{logf: o.Logf, interval: o.Interval, markIO: o.RequestTimeout}
	if s.interval <= 0 {
		s.interval = DefaultInterval
	}
	if s.markIO <= 0 {
		s.markIO = DefaultRequestTimeout
	}
	opts := &nbdclient.Options{Logf: o.Logf, RequestTimeout: s.markIO, QueueTimeout: o.QueueTimeout, Verify: s.verify}
	r, err := nbdclient.Open(uri, opts)
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return nil, fmt.Errorf("%w: is the NBD server running, and is the URI right?", err)
	}
	if err != nil {
		return nil, err
	}
	exp := r.Export()
	caps := provider.Capabilities{
		Shared: true,
		// The NBD spec promises nothing about tearing; the export's preferred block is
		// the unit it says writes should come in, and 4096 what disks behind it use.
		AtomicWrite: 4096,
	}
	if exp.Flags&nbdproto.TflagSendWriteZeroes != 0 {
		// Without it, Punch writes the zeroes itself: nothing cheap to offer.
		caps.Punch = s.Punch
	}
	if pb := exp.PreferredBlock; pb >= 512 && pb <= 64<<10 {
		caps.AtomicWrite = int(pb)
	}
	if r.Size() < MarkOffset+MarkLen {
		r.Close()
		return nil, fmt.Errorf("%s: export of %d bytes is too small for an eli volume", r, r.Size())
	}
	s.raw, s.remote, s.name, s.caps = r, r, r.String(), caps
	ident := make([]byte, identRead)
	if err := s.readRaw(ident, 0); err != nil {
		r.Close()
		return nil, fmt.Errorf("read the start of %s: %w", s.name, err)
	}
	s.mu.Lock()
	s.ident = identity(ident)
	s.mu.Unlock()
	return s, nil
}

// newStore wraps any raw storage (tests).
func newStore(r raw, name string, interval time.Duration) *Store {
	s := &Store{raw: r, name: name, interval: interval, markIO: DefaultRequestTimeout}
	s.caps = provider.Capabilities{Shared: true, Punch: s.Punch, AtomicWrite: 4096}
	return s
}

// identLen is how much of the export's start identity looks at: an eli header's magic,
// version and length (bytes 0 to 16) and its volume ID (24 to 40), which no header
// update changes (docs/format.md).
const identLen = 40

// identRead is how much is read for it: a whole block, which any export takes.
const identRead = 4096

// identity is what of the export's first identLen bytes must stay the same while this
// Store uses it, or nil where they hold no eli header (an export being initialized).
func identity(b []byte) []byte {
	if b[0] != 0x89 || string(b[1:4]) != "ELI" {
		return nil
	}
	return append(append([]byte(nil), b[:16]...), b[24:40]...)
}

// ErrExportChanged: after a reconnection the export behind the URI was no longer this
// volume (another volume's bytes, or the mark of another instance): nothing more is
// written to it.
var ErrExportChanged = nbdclient.ErrExportChanged

// verify is the check nbdclient runs on every new connection before it replays
// anything: a Store that holds the mark must find it still its own, and any other must
// find the volume it opened.
func (s *Store) verify(read func([]byte, int64) error) error {
	s.mu.Lock()
	owned, m, ident := s.owned, s.mark, s.ident
	s.mu.Unlock()
	if owned {
		b := make([]byte, MarkLen)
		if err := read(b, MarkOffset); err != nil {
			return err
		}
		cur, err := decodeMark(b)
		if err == nil && cur.State == Held && cur.Instance == m.Instance {
			return nil
		}
		why := fmt.Errorf("the ownership mark of %s is not this server's any more (%s): the export was replaced or taken over", s.name, describe(cur, err))
		s.mu.Lock()
		s.fence, s.owned = fmt.Errorf("%w: %v", ErrTakenOver, why), false
		s.mu.Unlock()
		return why
	}
	if ident == nil {
		return nil
	}
	b := make([]byte, identRead)
	if err := read(b, 0); err != nil {
		return err
	}
	if got := identity(b); !bytes.Equal(got, ident) {
		return fmt.Errorf("%s no longer holds the volume it held (its header's volume ID changed): the export was replaced", s.name)
	}
	return nil
}

// describe says what a mark read back holds, for messages.
func describe(m Mark, err error) string {
	switch {
	case err != nil:
		return "unreadable: " + err.Error()
	case m.State == Empty:
		return "no mark"
	case m.State == Released:
		return "released"
	}
	return fmt.Sprintf("held by host %q, instance %s", m.Host, m.InstanceString())
}

// SetDeadline bounds every request to the storage, in progress or to come, by t
// (nbdclient.Remote.SetDeadline): for a server that must stop within a bound whatever
// the storage does. The zero time removes the bound.
func (s *Store) SetDeadline(t time.Time) {
	if s.remote != nil {
		s.remote.SetDeadline(t)
	}
}

// Health reports the state of the connections to the storage (zero for tests over a
// file).
func (s *Store) Health() nbdclient.Health {
	if s.remote == nil {
		return nbdclient.Health{Connected: true}
	}
	return s.remote.Health()
}

// Path names the export for messages: its URI, without secrets.
func (s *Store) Path() string { return s.name }

func (s *Store) Capabilities() provider.Capabilities { return s.caps }

func (s *Store) Size() int64 { return s.raw.Size() }

// Refresh asks the server for the export's size again (an export grown on the storage
// side) and returns it.
func (s *Store) Refresh() (int64, error) {
	if s.remote == nil {
		return s.raw.Size(), nil
	}
	return s.remote.Refresh()
}

// ReadAt reads from the export; the ownership block reads as zeroes.
func (s *Store) ReadAt(b []byte, off int64) (int, error) {
	n, err := s.raw.ReadAt(b, off)
	if lo, hi, ok := overlap(off, int64(n)); ok {
		clear(b[lo-off : hi-off])
	}
	return n, err
}

// WriteAt writes what lies outside the ownership block; it fails once fenced.
func (s *Store) WriteAt(b []byte, off int64) (int, error) {
	if err := s.fenced(); err != nil {
		return 0, err
	}
	lo, hi, ok := overlap(off, int64(len(b)))
	if !ok {
		return s.raw.WriteAt(b, off)
	}
	if lo > off {
		if _, err := s.raw.WriteAt(b[:lo-off], off); err != nil {
			return 0, err
		}
	}
	if end := off + int64(len(b)); hi < end {
		if _, err := s.raw.WriteAt(b[hi-off:], hi); err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

// Punch zeroes what lies outside the ownership block.
func (s *Store) Punch(off, n int64) error {
	if err := s.fenced(); err != nil {
		return err
	}
	lo, hi, ok := overlap(off, n)
	if !ok {
		return s.raw.Punch(off, n)
	}
	if lo > off {
		if err := s.raw.Punch(off, lo-off); err != nil {
			return err
		}
	}
	if hi < off+n {
		return s.raw.Punch(hi, off+n-hi)
	}
	return nil
}

// Sync is the export's flush; it fails once fenced, so nothing written after a
// takeover is reported durable.
func (s *Store) Sync() error {
	if err := s.fenced(); err != nil {
		return err
	}
	return s.raw.Sync()
}

// overlap is the part of [off, off+n) inside the ownership block.
func overlap(off, n int64) (lo, hi int64, ok bool) {
	lo, hi = max(off, MarkOffset), min(off+n, MarkOffset+MarkLen)
	return lo, hi, lo < hi
}

// ErrTakenOver is what writes return once another instance took the volume over.
var ErrTakenOver = fmt.Errorf("remote volume taken over by another eli instance: writes stopped: %w", syscall.EIO)

func (s *Store) fenced() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fence
}

// Fenced reports why writes stopped, or nil.
func (s *Store) Fenced() error { return s.fenced() }

// Close stops the heartbeat, releases the mark if this Store still holds it (so that
// the next attach takes the volume at once), and disconnects. Each request of the
// release is bounded by the request timeout, so Close ends even with the storage gone.
func (s *Store) Close() error {
	s.stopHeartbeat()
	var err error
	s.mu.Lock()
	release := s.owned && s.fence == nil
	s.owned = false
	m := s.mark
	s.mu.Unlock()
	if release {
		err = s.release(m)
	}
	if cerr := s.raw.Close(); err == nil {
		err = cerr
	}
	return err
}

// Handoff stops the heartbeat and disconnects without releasing the mark, for a
// process that passes the claim to another (attach to its background server, which
// calls Adopt with the instance ID returned).
func (s *Store) Handoff() (instance string, err error) {
	s.stopHeartbeat()
	s.mu.Lock()
	inst, owned := s.mark.InstanceString(), s.owned
	s.owned = false
	s.mu.Unlock()
	if !owned {
		return "", errors.New("handoff of a remote volume this process does not hold")
	}
	return inst, s.raw.Close()
}

func (s *Store) release(m Mark) error {
	cur, err := s.readMark()
	if err != nil {
		return fmt.Errorf("release the ownership mark of %s: %w", s.name, err)
	}
	if cur.State != Held || cur.Instance != m.Instance {
		return nil // someone else's now: not ours to clear
	}
	m.State, m.Counter, m.Time = Released, cur.Counter+1, time.Now()
	if err := s.writeMark(m); err != nil {
		return fmt.Errorf("release the ownership mark of %s: %w", s.name, err)
	}
	return nil
}

func (s *Store) readMark() (Mark, error) {
	b := make([]byte, MarkLen)
	if err := s.readRaw(b, MarkOffset); err != nil {
		return Mark{}, err
	}
	return decodeMark(b)
}

// readRaw reads from the export, bounded by markIO: the mark's requests are never held
// while the storage is away (Options.QueueTimeout), so that a heartbeat, a claim or a
// release ends.
func (s *Store) readRaw(b []byte, off int64) error {
	if s.remote == nil {
		_, err := s.raw.ReadAt(b, off)
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.markIO)
	defer cancel()
	_, err := s.remote.ReadAtContext(ctx, b, off)
	return err
}

// writeMark writes m and flushes, so that a mark another host reads is on the storage;
// each request bounded as readRaw's.
func (s *Store) writeMark(m Mark) error {
	if s.remote == nil {
		if _, err := s.raw.WriteAt(m.encode(), MarkOffset); err != nil {
			return err
		}
		return s.raw.Sync()
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.markIO)
	defer cancel()
	if _, err := s.remote.WriteAtContext(ctx, m.encode(), MarkOffset); err != nil {
		return err
	}
	return s.remote.SyncContext(ctx)
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "unknown-host"
	}
	return h
}

package blockdev

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/elidisk/eli/sector"
)

// Re-encryption (docs/format.md, "Re-encryption"; docs/design.md, "Re-encryption"): the
// sectors of a volume move from one key (the previous one) to another (the current one)
// while the device serves. The device holds both in its keyring; everything written from
// the start on is sealed under the current key, and a sweep (Device.Sweep, in steps that
// a driver such as Sweeper paces) moves the rest, from sector 0 up, through the same
// write paths that clients use.
//
// How a reader tells which key sealed a sector differs with the kind of mode:
//
//   - authenticated modes: by trying. A sector's tag verifies under the key that sealed
//     it and, but with negligible probability, under no other, so each sector opens under
//     exactly one of the two keys whatever the sweep did, and a crash anywhere leaves
//     every sector readable. The sweep's cursor only says which key to try first and where
//     to resume; it is checkpointed in the header by the caller. A sector moves with one
//     write of its data (a read-modify-write under its stripe lock, committed through the
//     journal as any write): no hotzone, no second copy.
//   - length-preserving modes have no tag: a key opens anything. There the position
//     decides, and the sector the sweep rewrites in place is told apart by a hotzone
//     (hotzone.go): sectors below lo are under the current key, from hi under the previous
//     one, and for the window [lo, hi) the hotzone holds a checksum of each sector's old
//     ciphertext, durable before the window is rewritten.

// Reencrypt describes a re-encryption under way when the device opens (the volume's
// header holds the previous key).
type Reencrypt struct {
	// Prev opens what was sealed under the previous key. Its sector size is the device's;
	// in authenticated modes its mode is the device's too, in length-preserving ones it
	// may be any length-preserving mode (a mode change). The Device never wipes it.
	Prev sector.Codec
	// PrevJournalKey (authenticated modes) opens a journal sealed under the previous key:
	// the last one written before the re-encryption began. Open copies it; Close and
	// ForgetPrevious wipe the copy.
	PrevJournalKey []byte
	// Epoch is the volume's key epoch, which a length-preserving mode's hotzone records.
	Epoch uint64
	// Cursor is the header's checkpoint: every sector below it was under the current key
	// when it was taken. Authenticated modes resume their sweep there; length-preserving
	// modes resume where their hotzone says, which is never behind it.
	Cursor uint64
}

// ReencryptStatus is the state of a re-encryption on an open device.
type ReencryptStatus struct {
	// Active: the device holds a previous key.
	Active bool
	// Cursor: the sweep has moved every sector below it; Sectors is the device's count.
	Cursor, Sectors uint64
	// Moved counts the sectors the sweep re-sealed since the device opened; Unreadable
	// those it found opening under neither key (authenticated modes: damaged, or torn by
	// a crash on a provider whose atomic write is smaller than a sector), which it leaves
	// as they are: they read as I/O errors before and after.
	Moved, Unreadable uint64
	// Done: FinishSweep made every sector's move durable, so the previous key may go.
	Done bool
}

// Errors of re-encryption.
var (
	// ErrNotReencrypting: a sweep step on a device that holds no previous key.
	ErrNotReencrypting = errors.New("no re-encryption is under way on the device")
	// ErrReencrypting: StartReencrypt on a device that already has one under way.
	ErrReencrypting = errors.New("a re-encryption is already under way on the device")
	// ErrSweepNotDone: FinishSweep before the sweep reached the last sector, or
	// ForgetPrevious before FinishSweep.
	ErrSweepNotDone = errors.New("the sweep has not moved every sector yet")
)

// sweepState is what both engines keep of a sweep: the cursor and the counts. Steps run
// one at a time (mu).
type sweepState struct {
	mu         sync.Mutex
	cursor     atomic.Uint64 // every sector below it has moved (in the device's view)
	moved      atomic.Uint64
	unreadable atomic.Uint64
	done       atomic.Bool
}

// reencryptEngine is what an engine does for a re-encryption; the Device calls it with
// the gate held shared (sweepStep, finishSweep) or exclusively (the others).
type reencryptEngine interface {
	// startReencrypt begins a re-encryption: at Open (online false) ks is the previous
	// key set (which the authenticated engine takes before recovery); on a live device
	// (online) ks is the new current set, and the keys it held become the previous ones.
	startReencrypt(ks keySet, r Reencrypt, online bool) error
	// sweepStep moves up to n sectors from the cursor.
	sweepStep(n uint64) error
	// finishSweep makes every move durable once the cursor is at the end.
	finishSweep() error
	// forgetPrevious drops the previous keys (after finishSweep).
	forgetPrevious() error
	sweepStatus() *sweepState
}

// prevKeySet builds the previous key set of r for a device of layout l and codec cur.
func prevKeySet(l Layout, cur sector.Codec, r Reencrypt) (keySet, error) {
	p := r.Prev
	if p == nil {
		return keySet{}, errors.New("re-encryption without the previous key's codec")
	}
	if p.SectorSize() != l.SectorSize || p.MetaSize() != cur.MetaSize() || (cur.MetaSize() > 0 && p.Mode() != cur.Mode()) {
		return keySet{}, fmt.Errorf("the previous key's codec (%s, %d-byte sectors) cannot re-encrypt in place into %s with %d-byte sectors",
			p.Mode(), p.SectorSize(), cur.Mode(), l.SectorSize)
	}
	ks, err := newKeySet(p)
	if err != nil {
		return keySet{}, err
	}
	if l.Authenticated() {
		if err := ks.setJournalKey(r.PrevJournalKey); err != nil {
			return keySet{}, fmt.Errorf("previous %w", err)
		}
	}
	return ks, nil
}

// StartReencrypt begins a re-encryption on an open device: the keys it holds become the
// previous ones, and codec (and, in authenticated modes, journalKey) the current ones,
// which seal everything written from now on. The sweep starts at sector 0. The caller
// first makes the volume's header say so (keys.BeginReencrypt), so that a crash from
// here on finds both keys. Requests in flight finish first.
func (d *Device) StartReencrypt(codec sector.Codec, journalKey []byte, epoch uint64) error {
	if err := d.lockGate(); err != nil {
		return err
	}
	defer d.gate.Unlock()
	switch {
	case d.ro:
		return ErrReadOnly
	case d.keys.prev != nil:
		return ErrReencrypting
	}
	next, err := newKeySet(codec)
	if err != nil {
		return fmt.Errorf("re-encrypt: %w", err)
	}
	if codec.SectorSize() != d.s || codec.MetaSize() != d.l.MetaSize() ||
		(d.l.Authenticated() && codec.Mode() != d.keys.cur.codec.Mode()) {
		return fmt.Errorf("re-encrypt: %s with %d-byte sectors cannot replace %s in place", codec.Mode(), codec.SectorSize(), d.keys.cur.codec.Mode())
	}
	if d.l.Authenticated() {
		if err := next.setJournalKey(journalKey); err != nil {
			return fmt.Errorf("re-encrypt: %w", err)
		}
	}
	re := d.eng.(reencryptEngine)
	if err := re.startReencrypt(next, Reencrypt{Prev: d.keys.cur.codec, Epoch: epoch}, true); err != nil {
		next.wipeJournal()
		return fmt.Errorf("re-encrypt: %w", err)
	}
	return nil
}

// Sweep moves up to n sectors from the sweep's cursor to the current key and returns the
// status after. Steps are serialized; requests go on meanwhile, each waiting at most for
// the sectors a step holds. In authenticated modes what a step moves goes into the
// pending batch like any write: a Flush makes it durable. In length-preserving modes a
// step is durable when it returns.
func (d *Device) Sweep(n uint64) (ReencryptStatus, error) {
	if err := d.enterGate(true); err != nil {
		return ReencryptStatus{}, err
	}
	defer d.leave()
	if d.keys.prev == nil {
		return d.reencryptStatus(), ErrNotReencrypting
	}
	err := d.eng.(reencryptEngine).sweepStep(n)
	return d.reencryptStatus(), err
}

// FinishSweep makes durable every move of a sweep that has reached the last sector, and,
// in authenticated modes, leaves the journal sealed under the current key: after it, no
// sector and no journal needs the previous key, and the caller may drop it from the
// header (keys.FinishReencrypt), then call ForgetPrevious.
func (d *Device) FinishSweep() error {
	if err := d.enterGate(true); err != nil {
		return err
	}
	defer d.leave()
	if d.keys.prev == nil {
		return ErrNotReencrypting
	}
	re := d.eng.(reencryptEngine)
	st := re.sweepStatus()
	st.mu.Lock()
	defer st.mu.Unlock()
	if c := st.cursor.Load(); c < d.l.Sectors {
		return fmt.Errorf("%w (at sector %d of %d)", ErrSweepNotDone, c, d.l.Sectors)
	}
	if err := re.finishSweep(); err != nil {
		return err
	}
	st.done.Store(true)
	return nil
}

// ForgetPrevious drops the previous keys once FinishSweep has returned and the header no
// longer holds them: it wipes the previous journal key (the previous codec is the
// caller's to wipe) and the device is as one opened without a re-encryption. Requests in
// flight finish first.
func (d *Device) ForgetPrevious() error {
	if err := d.lockGate(); err != nil {
		return err
	}
	defer d.gate.Unlock()
	if d.keys.prev == nil {
		return ErrNotReencrypting
	}
	re := d.eng.(reencryptEngine)
	if !re.sweepStatus().done.Load() {
		return ErrSweepNotDone
	}
	return re.forgetPrevious()
}

// Reencryption reports the state of a re-encryption (Active false when none is under
// way, or once ForgetPrevious returned).
func (d *Device) Reencryption() ReencryptStatus {
	d.gate.RLock()
	defer d.gate.RUnlock()
	return d.reencryptStatus()
}

func (d *Device) reencryptStatus() ReencryptStatus {
	if d.keys.prev == nil {
		return ReencryptStatus{Sectors: d.l.Sectors}
	}
	st := d.eng.(reencryptEngine).sweepStatus()
	return ReencryptStatus{
		Active: true, Cursor: st.cursor.Load(), Sectors: d.l.Sectors,
		Moved: st.moved.Load(), Unreadable: st.unreadable.Load(), Done: st.done.Load(),
	}
}

// The authenticated engine's sweep.

func (a *authEngine) sweepStatus() *sweepState { return &a.sweep }

// startReencrypt: at Open the previous keys go in before recovery, which may find a
// journal sealed under either key; online, the committer is held while the keys change,
// since it seals journals without the gate.
func (a *authEngine) startReencrypt(ks keySet, r Reencrypt, online bool) error {
	if !online {
		a.keys.prev = &ks
		a.sweep.cursor.Store(min(r.Cursor, a.l.Sectors))
		return nil
	}
	a.commits.hold()
	defer a.commits.release()
	prev := a.keys.cur
	a.keys.cur, a.keys.prev = ks, &prev
	a.sweep.cursor.Store(0)
	a.sweep.moved.Store(0)
	a.sweep.unreadable.Store(0)
	a.sweep.done.Store(false)
	return nil
}

// sweepPieceBytes bounds one piece of an authenticated sweep step: the stripe locks of
// its sectors are held from its read to its insert, and client writes to those stripes
// wait for it. A piece is read, opened and sealed in parallel chunks; larger pieces
// cost more CPU a byte (BenchmarkReencrypt measures the choice).
const sweepPieceBytes = 256 << 10

func (a *authEngine) sweepStep(n uint64) error {
	st := &a.sweep
	st.mu.Lock()
	defer st.mu.Unlock()
	first := st.cursor.Load()
	end := min(a.l.Sectors, first+n)
	piece := uint64(max(1, min(a.pieceSectors, sweepPieceBytes/a.s)))
	for first < end {
		k := min(end-first, piece)
		if err := a.sweepPiece(first, int(k)); err != nil {
			return err
		}
		first += k
		st.cursor.Store(first)
	}
	return nil
}

// sweepPiece moves sectors [first, first+n) that are under the previous key: it reads
// them as a client read does (through the batches, so a write not committed yet is what
// it finds), and seals those that opened under the previous key again under the current
// one, chunk by chunk as each is opened, into the pending batch. Its stripe locks, held
// from the read to the insert, make it a read-modify-write: a client write of one of
// these sectors lands before the read, and is what moves, or after the insert, and
// replaces it. Sectors with a zero record (never written, trimmed) and sectors already
// under the current key are left alone, and so are sectors that open under neither key.
func (a *authEngine) sweepPiece(first uint64, n int) error {
	slabs := a.batches.slabs
	cost := slabs.bytes(n)
	if err := a.batches.reserve(cost); err != nil {
		return err
	}
	sl := slabs.get(n)
	defer slabs.release(sl) // inserted entries hold their own references
	rp := a.getRecs(n)
	defer a.putRecs(rp)
	recs := *rp
	s := a.s
	out := readOut{prev: make([]bool, n)}
	seal := func(lo, hi int) {
		for x := lo; x < hi; {
			if !out.prev[x] {
				x++
				continue
			}
			y := x + 1
			for y < hi && out.prev[y] {
				y++
			}
			buf := sl.buf[x*s : y*s]
			a.keys.cur.meta.SealRunMeta(first+uint64(x), buf, buf, recordBytes(recs[x:y]))
			x = y
		}
	}
	out.seal = seal
	a.locks.lock(first, uint64(n))
	defer a.locks.unlock(first, uint64(n))
	if err := a.read(sl.buf[:n*s], first, n, &out); err != nil {
		a.batches.unreserve(cost)
		return err
	}
	for _, k := range out.moved {
		seal(k, k+1) // taken from the committing batch after its chunk's seal
	}
	a.sweep.unreadable.Add(uint64(len(out.bad)))
	inserted := false
	for x := 0; x < n; {
		if !out.prev[x] {
			x++
			continue
		}
		y := x + 1
		for y < n && out.prev[y] {
			y++
		}
		c := int64(0)
		if !inserted {
			c, inserted = cost, true // the slab's cost, once
		}
		a.batches.insert(first+uint64(x), y-x, sl, x*s, recs[x:y], c)
		a.sweep.moved.Add(uint64(y - x))
		x = y
	}
	if !inserted {
		a.batches.unreserve(cost)
	}
	return nil
}

// finishSweep flushes, so that every move is durable (in version 2, completed by a later
// slot), then writes one more journal under the current key: a volume whose journal
// opens only under the previous key would lose its journal (version 1: nothing to replay,
// harmless) or, in version 2, the root that authenticates its tree, once that key is
// dropped.
func (a *authEngine) finishSweep() error {
	if err := a.flush(); err != nil {
		return err
	}
	if err := a.commits.markCompletedNow(); err != nil {
		return fmt.Errorf("seal the journal under the new key: %w", err)
	}
	return nil
}

func (a *authEngine) forgetPrevious() error {
	a.commits.hold()
	defer a.commits.release()
	a.keys.forgetPrevious()
	return nil
}

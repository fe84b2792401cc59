package blockdev

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"

	"github.com/elidisk/eli/provider"
)

// recorder is a provider that records every write, punch and sync, so that a test can
// build the provider's contents after a crash at any point of the log.
type recorder struct {
	mu     sync.Mutex
	base   []byte // contents when recording began
	cur    []byte // contents with every recorded event applied: what reads see
	events []ioEvent
	failAt int // with failAt ≥ 0, the event with that index and all later ones fail
	// mapped: WriteMapped takes writes, as provider.File does on tmpfs; a crash tears
	// them at any byte rather than at the atomic unit.
	mapped bool
}

type evKind uint8

const (
	evWrite evKind = iota
	evPunch
	evSync
)

type ioEvent struct {
	kind evKind
	off  int64
	data []byte // evWrite
	n    int64  // evPunch
	// mapped: an evWrite made by WriteMapped, which a crash tears at any byte.
	mapped bool
}

var errCrashed = errors.New("provider crashed (test)")

func newRecorder(image []byte) *recorder {
	return &recorder{base: bytes.Clone(image), cur: bytes.Clone(image), failAt: -1}
}

func (r *recorder) Size() int64 { return int64(len(r.base)) }

func (r *recorder) ReadAt(b []byte, off int64) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if off < 0 || off+int64(len(b)) > int64(len(r.cur)) {
		return 0, fmt.Errorf("recorder: read [%d, %d) outside %d bytes", off, off+int64(len(b)), len(r.cur))
	}
	return copy(b, r.cur[off:]), nil
}

func (r *recorder) record(e ioEvent) error {
	if r.failAt >= 0 && len(r.events) >= r.failAt {
		return errCrashed
	}
	if e.kind != evSync && (e.off < 0 || e.off+max(int64(len(e.data)), e.n) > int64(len(r.cur))) {
		return fmt.Errorf("recorder: event outside the provider: %+v", e)
	}
	r.events = append(r.events, e)
	switch e.kind {
	case evWrite:
		copy(r.cur[e.off:], e.data)
	case evPunch:
		clear(r.cur[e.off : e.off+e.n])
	}
	return nil
}

func (r *recorder) WriteAt(b []byte, off int64) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.record(ioEvent{kind: evWrite, off: off, data: bytes.Clone(b)}); err != nil {
		return 0, err
	}
	return len(b), nil
}

func (r *recorder) WriteMapped(b []byte, off int64) (bool, error) {
	if !r.mapped {
		return false, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return true, r.record(ioEvent{kind: evWrite, off: off, data: bytes.Clone(b), mapped: true})
}

func (r *recorder) Capabilities() provider.Capabilities {
	return provider.Capabilities{Punch: r.Punch, WriteMapped: r.WriteMapped}
}

func (r *recorder) Punch(off, n int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.record(ioEvent{kind: evPunch, off: off, n: n})
}

func (r *recorder) Sync() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.record(ioEvent{kind: evSync})
}

func (r *recorder) numEvents() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.events)
}

// crashImage is the provider after a crash once events [0, c) were issued: every write
// before the last sync survives; each later one survives whole, not at all, or torn
// (each atomic unit of it independently), chosen by rng. Writes between two syncs never
// overlap in eli's protocol, so the order they are applied in does not matter.
func (r *recorder) crashImage(c int, unit int64, rng *rand.Rand) (img []byte, torn int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	img = bytes.Clone(r.base)
	lastSync := -1
	for i := 0; i < c; i++ {
		if r.events[i].kind == evSync {
			lastSync = i
		}
	}
	for i := 0; i < c; i++ {
		e := r.events[i]
		if e.kind == evSync {
			continue
		}
		if i < lastSync {
			apply(img, e, e.off, e.off+e.size())
			continue
		}
		switch rng.IntN(3) {
		case 0: // lost
		case 1:
			apply(img, e, e.off, e.off+e.size())
		case 2: // torn: each piece kept or not
			end := e.off + e.size()
			kept := 0
			pieces := tornPieces(e, unit, rng)
			for k, a := range pieces {
				b := end
				if k+1 < len(pieces) {
					b = pieces[k+1]
				}
				if rng.IntN(2) == 0 {
					apply(img, e, a, b)
					kept++
				}
			}
			if kept > 0 && kept < len(pieces) {
				torn++
			}
		}
	}
	return img, torn
}

// tornPieces gives the start offsets of the pieces a crash may keep or lose of write e
// independently: its atomic units, or for a mapped write (a memory copy cut short) up to
// 8 pieces cut at random bytes.
func tornPieces(e ioEvent, unit int64, rng *rand.Rand) []int64 {
	end := e.off + e.size()
	var starts []int64
	if !e.mapped {
		for a := e.off; a < end; a = min(end, (a/unit+1)*unit) {
			starts = append(starts, a)
		}
		return starts
	}
	starts = append(starts, e.off)
	for range 1 + rng.IntN(7) {
		starts = append(starts, e.off+1+rng.Int64N(max(1, e.size()-1)))
	}
	slices.Sort(starts)
	return slices.Compact(starts)
}

func (e ioEvent) size() int64 {
	if e.kind == evWrite {
		return int64(len(e.data))
	}
	return e.n
}

// apply applies the part [a, b) of event e to img.
func apply(img []byte, e ioEvent, a, b int64) {
	switch e.kind {
	case evWrite:
		copy(img[a:b], e.data[a-e.off:b-e.off])
	case evPunch:
		clear(img[a:b])
	}
}

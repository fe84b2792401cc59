package blockdev

import (
	"fmt"

	"github.com/elidisk/eli/sector"
)

// plainEngine is the engine of length-preserving modes (MetaSize 0): sector i is at
// D + i·S, there is no record, no batch and no journal. Writes encrypt and go straight to
// the provider; Flush syncs. A crash can tear a sector like on any plain disk (these
// modes promise no more).
//
// Whole sectors go to the codec a chunk (chunkSectors) at a time through sector.Runner.
// During a re-encryption (plain_reencrypt.go) a request holds the re-encryption's lock
// shared, and each run of its sectors goes to the key its position says.
type plainEngine struct {
	*core
	re    *plainReenc // non-nil while a re-encryption is under way; changed under the gate
	sweep sweepState
}

func newPlainEngine(c *core) *plainEngine { return &plainEngine{core: c} }

func (e *plainEngine) flush() error { return e.sync() }

func (e *plainEngine) close(suspended bool) error {
	if e.ro || suspended {
		return nil
	}
	return e.sync()
}

// suspend syncs: every write is in place once it returns, and nothing else holds data.
func (e *plainEngine) suspend() error { return e.close(false) }

// withKeys: the engine has no goroutine of its own that uses keys.
func (e *plainEngine) withKeys(f func()) { f() }

// loadMeta has nothing to load: there are no records.
func (e *plainEngine) loadMeta(off, length int64) error { return nil }

// extents reports everything as data: without records, nothing says what was written.
func (e *plainEngine) extents(off, length int64) ([]Extent, error) {
	return []Extent{{Length: length}}, nil
}

func (e *plainEngine) recovery() Recovery { return Recovery{Journal: "none"} }

func (e *plainEngine) cacheStats(st *Stats) {}

// keyRuns calls fn for each run [lo, hi) of sectors first+lo… (hi ≤ n) under one key set,
// in order. Without a re-encryption that is one run under the current keys.
func (e *plainEngine) keyRuns(first uint64, n int, fn func(lo, hi int, ks *keySet) error) error {
	if e.re == nil {
		return fn(0, n, &e.keys.cur)
	}
	for k := 0; k < n; {
		cur := e.re.current(first + uint64(k))
		j := k + 1
		for j < n && e.re.current(first+uint64(j)) == cur {
			j++
		}
		ks := &e.keys.cur
		if !cur {
			ks = e.keys.prev
		}
		if err := fn(k, j, ks); err != nil {
			return err
		}
		k = j
	}
	return nil
}

func (e *plainEngine) readSectors(dst []byte, first uint64, n int) error {
	if e.re != nil {
		if err := e.re.enter(first, uint64(n)); err != nil {
			return err
		}
		defer e.re.leave()
	}
	return e.readKeyed(dst, first, n)
}

// readKeyed is readSectors for a caller that holds the re-encryption's lock, if any.
func (e *plainEngine) readKeyed(dst []byte, first uint64, n int) error {
	// Each chunk is read and decrypted by one worker, while it is in that core's cache.
	return e.workers.runRead(n, e.chunkSectors, func(lo, hi int) error {
		chunk := dst[lo*e.s : hi*e.s]
		if _, err := e.p.ReadAt(chunk, e.geo.dataPos(first+uint64(lo))); err != nil {
			return fmt.Errorf("read sectors %d-%d: %w", first+uint64(lo), first+uint64(hi-1), err)
		}
		return e.keyRuns(first+uint64(lo), hi-lo, func(a, b int, ks *keySet) error {
			part := chunk[a*e.s : b*e.s]
			if err := ks.plain.OpenRun(first+uint64(lo+a), part, part); err != nil {
				return fmt.Errorf("read: %w", err)
			}
			return nil
		})
	})
}

// sealRun encrypts the n sectors of src, first…, into dst, each run under its key.
func (e *plainEngine) sealRun(first uint64, dst, src []byte, n int) {
	_ = e.keyRuns(first, n, func(a, b int, ks *keySet) error {
		ks.plain.SealRun(first+uint64(a), dst[a*e.s:b*e.s], src[a*e.s:b*e.s])
		return nil
	})
}

// seal encrypts n sectors of buf in place as sectors first….
func (e *plainEngine) seal(buf []byte, first uint64, n int) {
	e.workers.run(n, e.chunkSectors, func(lo, hi int) error {
		chunk := buf[lo*e.s : hi*e.s]
		e.sealRun(first+uint64(lo), chunk, chunk, hi-lo)
		return nil
	})
}

// enter takes the re-encryption's lock for the sectors of [off, off+length), if one is
// under way, and returns what releases it.
func (e *plainEngine) enter(off, length int64) (func(), error) {
	if e.re == nil || length <= 0 {
		return func() {}, nil
	}
	s := int64(e.s)
	first, end := off/s, (off+length+s-1)/s
	if err := e.re.enter(uint64(first), uint64(end-first)); err != nil {
		return nil, err
	}
	return e.re.leave, nil
}

func (e *plainEngine) writeAt(p []byte, off int64, flags Flags) error {
	leave, err := e.enter(off, int64(len(p)))
	if err != nil {
		return err
	}
	defer leave()
	// Mode none's ciphertext is the plaintext: the caller's buffer goes to the provider
	// as it is, without a copy (about an eighth of mode none's CPU per byte written;
	// docs/benchmarks.md). Not while some sectors may be under another key.
	none := e.keys.cur.codec.Mode() == sector.ModeNone && e.re == nil
	var bp *[]byte
	if !none {
		bp = e.getBuf()
		defer e.putBuf(bp)
	}
	err = e.forSectors(p, off, func(p []byte, first uint64, n int) error {
		if none {
			return e.writeSealed(p, first, n)
		}
		buf := (*bp)[:len(p)]
		// Encrypt from the caller's buffer, which must stay as it is, a chunk at a time:
		// a run lets xchacha*-xts derive its per-sector subkeys in batches.
		e.workers.run(n, e.chunkSectors, func(lo, hi int) error {
			e.sealRun(first+uint64(lo), buf[lo*e.s:hi*e.s], p[lo*e.s:hi*e.s], hi-lo)
			return nil
		})
		return e.writeSealed(buf, first, n)
	}, e.writePartial)
	if err == nil && flags&FUA != 0 {
		err = e.sync()
	}
	return err
}

// writeWhole encrypts n sectors of plaintext buf (which it overwrites) and writes
// them under the sectors' locks, so a concurrent read-modify-write cannot undo them.
func (e *plainEngine) writeWhole(buf []byte, first uint64, n int) error {
	e.seal(buf, first, n)
	return e.writeSealed(buf, first, n)
}

// writeSealed writes n encrypted sectors.
func (e *plainEngine) writeSealed(buf []byte, first uint64, n int) error {
	e.locks.lock(first, uint64(n))
	defer e.locks.unlock(first, uint64(n))
	if _, err := e.p.WriteAt(buf, e.geo.dataPos(first)); err != nil {
		return fmt.Errorf("write sectors %d-%d: %w", first, first+uint64(n-1), err)
	}
	e.wrote()
	return nil
}

// wrote notes a write not synced yet, which a re-encryption's window must not checksum
// before it is durable (plain_reencrypt.go).
func (e *plainEngine) wrote() {
	if e.re != nil {
		e.re.dirty.Store(true)
	}
}

// writePartial is a read-modify-write of sector i; the caller holds the re-encryption's
// lock, if any, which comes before the sector's.
func (e *plainEngine) writePartial(i uint64, o int, part []byte) error {
	bp := e.getBuf()
	defer e.putBuf(bp)
	buf := (*bp)[:e.s]
	e.locks.lock(i, 1)
	defer e.locks.unlock(i, 1)
	if err := e.readKeyed(buf, i, 1); err != nil {
		return err
	}
	copy(buf[o:], part)
	e.sealRun(i, buf, buf, 1)
	if _, err := e.p.WriteAt(buf, e.geo.dataPos(i)); err != nil {
		return fmt.Errorf("write sector %d: %w", i, err)
	}
	e.wrote()
	return nil
}

// trim punches whole sectors out where the provider can; a trim is advisory, so
// elsewhere it does nothing.
func (e *plainEngine) trim(first, n uint64, flags Flags) error {
	if e.caps.Punch == nil {
		return nil
	}
	if e.re != nil {
		if err := e.re.enter(first, n); err != nil {
			return err
		}
		defer e.re.leave()
	}
	if err := e.caps.Punch(e.geo.dataPos(first), int64(n)*int64(e.s)); err != nil {
		return fmt.Errorf("trim sectors %d-%d: %w", first, first+n-1, err)
	}
	e.wrote()
	if flags&FUA != 0 {
		return e.sync()
	}
	return nil
}

// writeZeroes writes encrypted zeroes. Only mode none, whose zero plaintext is zero
// ciphertext, can punch instead, and only whole sectors.
func (e *plainEngine) writeZeroes(off, length int64, flags Flags) error {
	leave, err := e.enter(off, length)
	if err != nil {
		return err
	}
	defer leave()
	punch := e.caps.Punch
	s := int64(e.s)
	canPunch := punch != nil && e.keys.cur.codec.Mode() == sector.ModeNone && e.re == nil && flags&NoHole == 0
	if flags&FastZero != 0 && (!canPunch || off%s != 0 || length%s != 0) {
		return ErrSlowZero
	}
	bp := e.getBuf()
	defer e.putBuf(bp)
	for length > 0 {
		i, o := uint64(off/s), off%s
		if o != 0 || length < s {
			n := min(length, s-o)
			if err := e.writePartial(i, int(o), zeroes(int(n))); err != nil {
				return err
			}
			off, length = off+n, length-n
			continue
		}
		n := min(length/s, int64(e.pieceSectors))
		if canPunch {
			n = length / s
			e.locks.lock(i, uint64(n))
			err := punch(e.geo.dataPos(i), n*s)
			e.locks.unlock(i, uint64(n))
			if err != nil {
				return fmt.Errorf("zero sectors %d-%d: %w", i, i+uint64(n-1), err)
			}
		} else {
			buf := (*bp)[:n*s]
			clear(buf)
			if err := e.writeWhole(buf, i, int(n)); err != nil {
				return err
			}
		}
		off, length = off+n*s, length-n*s
	}
	if flags&FUA != 0 {
		return e.sync()
	}
	return nil
}

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
type plainEngine struct {
	*core
}

func newPlainEngine(c *core) *plainEngine { return &plainEngine{core: c} }

func (e *plainEngine) flush() error { return e.sync() }

func (e *plainEngine) close() error {
	if e.ro {
		return nil
	}
	return e.sync()
}

// loadMeta has nothing to load: there are no records.
func (e *plainEngine) loadMeta(off, length int64) error { return nil }

// extents reports everything as data: without records, nothing says what was written.
func (e *plainEngine) extents(off, length int64) ([]Extent, error) {
	return []Extent{{Length: length}}, nil
}

func (e *plainEngine) recovery() Recovery { return Recovery{Journal: "none"} }

func (e *plainEngine) cacheStats(st *Stats) {}

func (e *plainEngine) readSectors(dst []byte, first uint64, n int) error {
	// Each chunk is read and decrypted by one worker, while it is in that core's cache.
	return e.workers.runRead(n, e.chunkSectors, func(lo, hi int) error {
		chunk := dst[lo*e.s : hi*e.s]
		if _, err := e.p.ReadAt(chunk, e.geo.dataPos(first+uint64(lo))); err != nil {
			return fmt.Errorf("read sectors %d-%d: %w", first+uint64(lo), first+uint64(hi-1), err)
		}
		if err := e.keys.plain.OpenRun(first+uint64(lo), chunk, chunk); err != nil {
			return fmt.Errorf("read: %w", err)
		}
		return nil
	})
}

// seal encrypts n sectors of buf in place as sectors first….
func (e *plainEngine) seal(buf []byte, first uint64, n int) {
	e.workers.run(n, e.chunkSectors, func(lo, hi int) error {
		chunk := buf[lo*e.s : hi*e.s]
		e.keys.plain.SealRun(first+uint64(lo), chunk, chunk)
		return nil
	})
}

func (e *plainEngine) writeAt(p []byte, off int64, flags Flags) error {
	// Mode none's ciphertext is the plaintext: the caller's buffer goes to the provider
	// as it is, without a copy (about an eighth of mode none's CPU per byte written;
	// docs/benchmarks.md).
	none := e.keys.codec.Mode() == sector.ModeNone
	var bp *[]byte
	if !none {
		bp = e.getBuf()
		defer e.putBuf(bp)
	}
	err := e.forSectors(p, off, func(p []byte, first uint64, n int) error {
		if none {
			return e.writeSealed(p, first, n)
		}
		buf := (*bp)[:len(p)]
		// Encrypt from the caller's buffer, which must stay as it is, a chunk at a time:
		// a run lets xchacha*-xts derive its per-sector subkeys in batches.
		e.workers.run(n, e.chunkSectors, func(lo, hi int) error {
			e.keys.plain.SealRun(first+uint64(lo), buf[lo*e.s:hi*e.s], p[lo*e.s:hi*e.s])
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
	return nil
}

func (e *plainEngine) writePartial(i uint64, o int, part []byte) error {
	bp := e.getBuf()
	defer e.putBuf(bp)
	buf := (*bp)[:e.s]
	e.locks.lock(i, 1)
	defer e.locks.unlock(i, 1)
	if err := e.readSectors(buf, i, 1); err != nil {
		return err
	}
	copy(buf[o:], part)
	e.keys.codec.Seal(i, buf, nil)
	if _, err := e.p.WriteAt(buf, e.geo.dataPos(i)); err != nil {
		return fmt.Errorf("write sector %d: %w", i, err)
	}
	return nil
}

// trim punches whole sectors out where the provider can; a trim is advisory, so
// elsewhere it does nothing.
func (e *plainEngine) trim(first, n uint64, flags Flags) error {
	if e.puncher == nil {
		return nil
	}
	if err := e.puncher.Punch(e.geo.dataPos(first), int64(n)*int64(e.s)); err != nil {
		return fmt.Errorf("trim sectors %d-%d: %w", first, first+n-1, err)
	}
	if flags&FUA != 0 {
		return e.sync()
	}
	return nil
}

// writeZeroes writes encrypted zeroes. Only mode none, whose zero plaintext is zero
// ciphertext, can punch instead, and only whole sectors.
func (e *plainEngine) writeZeroes(off, length int64, flags Flags) error {
	pu := e.puncher
	s := int64(e.s)
	canPunch := pu != nil && e.keys.codec.Mode() == sector.ModeNone && flags&NoHole == 0
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
			err := pu.Punch(e.geo.dataPos(i), n*s)
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

package blockdev

import (
	"fmt"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// Length-preserving modes (MetaSize 0): sector i is at D + i·S, there is no record, no
// batch and no journal. Writes encrypt and go straight to the provider; Flush syncs. A
// crash can tear a sector like on any plain disk (these modes promise no more).
//
// Whole sectors go to the codec a chunk (chunkSectors) at a time through sector.Runner.

func (d *Device) plainReadSectors(dst []byte, first uint64, n int) error {
	// Each chunk is read and decrypted by one worker, while it is in that core's cache.
	return d.workers.runRead(n, d.chunkSectors, func(lo, hi int) error {
		chunk := dst[lo*d.s : hi*d.s]
		if _, err := d.p.ReadAt(chunk, d.geo.dataPos(first+uint64(lo))); err != nil {
			return fmt.Errorf("read sectors %d-%d: %w", first+uint64(lo), first+uint64(hi-1), err)
		}
		if err := d.plainRuns.OpenRun(first+uint64(lo), chunk, chunk); err != nil {
			return fmt.Errorf("read: %w", err)
		}
		return nil
	})
}

// plainSeal encrypts n sectors of buf in place as sectors first….
func (d *Device) plainSeal(buf []byte, first uint64, n int) {
	d.workers.run(n, d.chunkSectors, func(lo, hi int) error {
		chunk := buf[lo*d.s : hi*d.s]
		d.plainRuns.SealRun(first+uint64(lo), chunk, chunk)
		return nil
	})
}

func (d *Device) plainWriteAt(p []byte, off int64, flags Flags) error {
	bp := d.getBuf()
	defer d.putBuf(bp)
	err := d.forSectors(p, off, func(p []byte, first uint64, n int) error {
		buf := (*bp)[:len(p)]
		// Encrypt from the caller's buffer, which must stay as it is, a chunk at a time:
		// a run lets xchacha*-xts derive its per-sector subkeys in batches.
		d.workers.run(n, d.chunkSectors, func(lo, hi int) error {
			d.plainRuns.SealRun(first+uint64(lo), buf[lo*d.s:hi*d.s], p[lo*d.s:hi*d.s])
			return nil
		})
		return d.plainWriteSealed(buf, first, n)
	}, d.plainWritePartial)
	if err == nil && flags&FUA != 0 {
		err = d.sync()
	}
	return err
}

// plainWriteWhole encrypts n sectors of plaintext buf (which it overwrites) and writes
// them under the sectors' locks, so a concurrent read-modify-write cannot undo them.
func (d *Device) plainWriteWhole(buf []byte, first uint64, n int) error {
	d.plainSeal(buf, first, n)
	return d.plainWriteSealed(buf, first, n)
}

// plainWriteSealed writes n encrypted sectors.
func (d *Device) plainWriteSealed(buf []byte, first uint64, n int) error {
	d.locks.lock(first, uint64(n))
	defer d.locks.unlock(first, uint64(n))
	if _, err := d.p.WriteAt(buf, d.geo.dataPos(first)); err != nil {
		return fmt.Errorf("write sectors %d-%d: %w", first, first+uint64(n-1), err)
	}
	return nil
}

func (d *Device) plainWritePartial(i uint64, o int, part []byte) error {
	bp := d.getBuf()
	defer d.putBuf(bp)
	buf := (*bp)[:d.s]
	d.locks.lock(i, 1)
	defer d.locks.unlock(i, 1)
	if err := d.plainReadSectors(buf, i, 1); err != nil {
		return err
	}
	copy(buf[o:], part)
	d.codec.Seal(i, buf, nil)
	if _, err := d.p.WriteAt(buf, d.geo.dataPos(i)); err != nil {
		return fmt.Errorf("write sector %d: %w", i, err)
	}
	return nil
}

// plainTrim punches whole sectors out where the provider can; a trim is advisory, so
// elsewhere it does nothing.
func (d *Device) plainTrim(first, n uint64, flags Flags) error {
	pu, ok := d.p.(provider.Puncher)
	if !ok {
		return nil
	}
	if err := pu.Punch(d.geo.dataPos(first), int64(n)*int64(d.s)); err != nil {
		return fmt.Errorf("trim sectors %d-%d: %w", first, first+n-1, err)
	}
	if flags&FUA != 0 {
		return d.sync()
	}
	return nil
}

// plainWriteZeroes writes encrypted zeroes. Only mode none, whose zero plaintext is zero
// ciphertext, can punch instead.
func (d *Device) plainWriteZeroes(off, length int64, flags Flags) error {
	pu, canPunch := d.p.(provider.Puncher)
	canPunch = canPunch && d.codec.Mode() == sector.ModeNone && flags&NoHole == 0
	if flags&FastZero != 0 && !canPunch {
		return ErrSlowZero
	}
	s := int64(d.s)
	bp := d.getBuf()
	defer d.putBuf(bp)
	for length > 0 {
		i, o := uint64(off/s), off%s
		if o != 0 || length < s {
			n := min(length, s-o)
			if err := d.plainWritePartial(i, int(o), zeroes(int(n))); err != nil {
				return err
			}
			off, length = off+n, length-n
			continue
		}
		n := min(length/s, int64(d.pieceSectors))
		if canPunch {
			n = length / s
			d.locks.lock(i, uint64(n))
			err := pu.Punch(d.geo.dataPos(i), n*s)
			d.locks.unlock(i, uint64(n))
			if err != nil {
				return fmt.Errorf("zero sectors %d-%d: %w", i, i+uint64(n-1), err)
			}
		} else {
			buf := (*bp)[:n*s]
			clear(buf)
			if err := d.plainWriteWhole(buf, i, int(n)); err != nil {
				return err
			}
		}
		off, length = off+n*s, length-n*s
	}
	if flags&FUA != 0 {
		return d.sync()
	}
	return nil
}

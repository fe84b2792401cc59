package blockdev

import (
	"unsafe"

	"github.com/elidisk/eli/layout"
)

// Writes in authenticated modes: each request seals its sectors into a slab (in the
// caller's goroutine, or the worker pool for large ones) and inserts them into the pending
// batch, replacing older entries of the same sectors. Nothing reaches the provider until
// the batch is committed (commit.go).

// recordBytes is recs as the contiguous bytes they are, for sector.MetaRunner.
func recordBytes(recs []record) []byte {
	if len(recs) == 0 {
		return nil
	}
	return unsafe.Slice(&recs[0][0], len(recs)*layout.RecordSize)
}

// writeWhole writes n whole sectors (n ≤ pieceSectors) from p and returns the sequence
// number of the batch that holds them.
func (a *authEngine) writeWhole(p []byte, first uint64, n int) (uint64, error) {
	// Reserve first: a writer waiting for room holds no slab, so the slabs in use are
	// within two batches (the pending one and the committing one).
	slabs := a.batches.slabs
	cost := slabs.bytes(n)
	if err := a.batches.reserve(cost); err != nil {
		return 0, err
	}
	sl := slabs.get(n)
	seq := a.sealInsert(sl, 0, p, first, n, cost)
	slabs.release(sl) // the entries hold their own references
	return seq, nil
}

// writeKept is writeWhole for a run that lies at byte base of a kept buffer (slab sl,
// Device.WriteKeep): it is sealed where it lies, and the batch keeps the buffer.
func (a *authEngine) writeKept(sl *slab, base int, first uint64, n int) (uint64, error) {
	// The buffer's capacity counts against the bound, not only the run's bytes.
	cost := (int64(n*a.s)*int64(cap(sl.buf)) + int64(len(sl.buf)) - 1) / int64(len(sl.buf))
	if err := a.batches.reserve(cost); err != nil {
		return 0, err
	}
	return a.sealInsert(sl, base, sl.buf[base:base+n*a.s], first, n, cost), nil
}

// sealInsert seals the n sectors of p into slab sl from byte base (p may be that part of
// sl itself) and inserts them into the pending batch, whose reservation cost was made.
func (a *authEngine) sealInsert(sl *slab, base int, p []byte, first uint64, n int, cost int64) uint64 {
	rp := a.getRecs(n)
	recs := *rp
	s := a.s
	dst := sl.buf[base : base+n*s]
	if n <= a.chunkSectors {
		// One chunk needs no pool, and this path no closure, which would escape to
		// the heap on every small write.
		a.keys.cur.meta.SealRunMeta(first, dst, p[:n*s], recordBytes(recs))
	} else {
		a.workers.run(n, a.chunkSectors, func(lo, hi int) error {
			a.keys.cur.meta.SealRunMeta(first+uint64(lo), dst[lo*s:hi*s], p[lo*s:hi*s], recordBytes(recs[lo:hi]))
			return nil
		})
	}
	a.locks.lock(first, uint64(n))
	seq := a.batches.insert(first, n, sl, base, recs, cost)
	a.locks.unlock(first, uint64(n))
	a.putRecs(rp)
	return seq
}

// writePartial writes part at offset o of sector i: read, modify, seal, insert, all under
// the sector's lock so that no other write of the sector can slip in between.
func (a *authEngine) writePartial(i uint64, o int, part []byte) (uint64, error) {
	slabs := a.batches.slabs
	cost := slabs.bytes(1)
	if err := a.batches.reserve(cost); err != nil {
		return 0, err
	}
	sl := slabs.get(1)
	a.locks.lock(i, 1)
	defer a.locks.unlock(i, 1)
	if err := a.readSectors(sl.buf[:a.s], i, 1); err != nil {
		a.batches.unreserve(cost)
		slabs.release(sl)
		return 0, err
	}
	copy(sl.buf[o:a.s], part)
	var rec [1]record
	a.keys.cur.codec.Seal(i, sl.buf[:a.s], rec[0][:])
	seq := a.batches.insert(i, 1, sl, 0, rec[:], cost)
	slabs.release(sl)
	return seq, nil
}

// zeroWhole gives sectors [first, first+n) a zero record, in pieces that fit a batch.
func (a *authEngine) zeroWhole(first, n uint64) (uint64, error) {
	// Pieces of half the smallest batch bound: each one finds room whenever the pending
	// batch is at most half full, however small the bound has adapted to be.
	piece := uint64(max(1, a.batches.batchFloor/zeroEntryCost/2))
	var seq uint64
	for n > 0 {
		k := min(n, piece)
		cost := int64(k) * zeroEntryCost
		if err := a.batches.reserve(cost); err != nil {
			return 0, err
		}
		a.locks.lock(first, k)
		seq = a.batches.insertZeroes(first, k, cost)
		a.locks.unlock(first, k)
		first, n = first+k, n-k
	}
	return seq, nil
}

// getRecs returns scratch for n records.
func (a *authEngine) getRecs(n int) *[]record {
	rp := a.recPool.Get().(*[]record)
	if cap(*rp) < n {
		*rp = make([]record, a.pieceSectors)
	}
	*rp = (*rp)[:n]
	return rp
}

func (a *authEngine) putRecs(rp *[]record) { a.recPool.Put(rp) }

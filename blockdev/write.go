package blockdev

import (
	"time"
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
func (d *Device) writeWhole(p []byte, first uint64, n int) (uint64, error) {
	// Reserve first: a writer waiting for room holds no slab, so the slabs in use are
	// within two batches (the pending one and the committing one).
	cost := d.slabs.bytes(n)
	if err := d.reserve(cost); err != nil {
		return 0, err
	}
	sl := d.slabs.get(n)
	rp := d.getRecs(n)
	recs := *rp
	s := d.s
	d.workers.run(n, d.chunkSectors, func(lo, hi int) error {
		d.runs.SealRunMeta(first+uint64(lo), sl.buf[lo*s:hi*s], p[lo*s:hi*s], recordBytes(recs[lo:hi]))
		return nil
	})
	d.locks.lock(first, uint64(n))
	seq := d.insert(first, n, sl, recs, cost)
	d.locks.unlock(first, uint64(n))
	d.putRecs(rp)
	d.slabs.release(sl) // the entries hold their own references
	return seq, nil
}

// writePartial writes part at offset o of sector i: read, modify, seal, insert, all under
// the sector's lock so that no other write of the sector can slip in between.
func (d *Device) writePartial(i uint64, o int, part []byte) (uint64, error) {
	cost := d.slabs.bytes(1)
	if err := d.reserve(cost); err != nil {
		return 0, err
	}
	sl := d.slabs.get(1)
	d.locks.lock(i, 1)
	defer d.locks.unlock(i, 1)
	if err := d.readSectors(sl.buf[:d.s], i, 1); err != nil {
		d.unreserve(cost)
		d.slabs.release(sl)
		return 0, err
	}
	copy(sl.buf[o:d.s], part)
	var rec [1]record
	d.codec.Seal(i, sl.buf[:d.s], rec[0][:])
	seq := d.insert(i, 1, sl, rec[:], cost)
	d.slabs.release(sl)
	return seq, nil
}

// zeroWhole gives sectors [first, first+n) a zero record, in pieces that fit a batch.
func (d *Device) zeroWhole(first, n uint64, punch bool) (uint64, error) {
	// Pieces of half the smallest batch bound: each one finds room whenever the pending
	// batch is at most half full, however small the bound has adapted to be.
	piece := uint64(max(1, d.batchFloor/zeroEntryCost/2))
	var seq uint64
	for n > 0 {
		k := min(n, piece)
		cost := int64(k) * zeroEntryCost
		if err := d.reserve(cost); err != nil {
			return 0, err
		}
		d.locks.lock(first, k)
		d.mu.Lock()
		b := d.pending
		for x := range k {
			d.replaceLocked(b, first+x, entry{punch: punch})
		}
		seq = d.addedLocked(b, cost)
		d.mu.Unlock()
		d.locks.unlock(first, k)
		first, n = first+k, n-k
	}
	return seq, nil
}

// insert puts n sealed sectors of slab sl into the pending batch.
func (d *Device) insert(first uint64, n int, sl *slab, recs []record, cost int64) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	b := d.pending
	sl.refs.Add(int32(n))
	for k := range n {
		d.replaceLocked(b, first+uint64(k), entry{slab: sl, off: int32(k * d.s), rec: recs[k]})
	}
	return d.addedLocked(b, cost)
}

// replaceLocked makes e sector i's entry in b.
func (d *Device) replaceLocked(b *batch, i uint64, e entry) {
	if old, replaced := b.entries.put(i, e); replaced && old.slab != nil {
		d.slabs.release(old.slab)
	}
}

// addedLocked accounts for cost bytes moved from the reservation into batch b and wakes
// the committer when the batch starts or fills.
func (d *Device) addedLocked(b *batch, cost int64) uint64 {
	d.reserved -= cost
	if b.bytes == 0 {
		b.first = d.now()
		d.poke()
	}
	b.bytes += cost
	if b.cost() >= d.commitBytes {
		d.poke()
	}
	return b.seq
}

func (d *Device) now() int64 { return int64(time.Since(d.epoch)) }

// reserve waits until the pending batch has room for cost more bytes (or is empty: a
// request bigger than MaxBatchBytes still goes through, alone) and reserves them. This
// is the backpressure that bounds memory: writers wait for commits.
func (d *Device) reserve(cost int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		if d.failed != nil {
			return d.failed
		}
		used := d.pending.cost() + d.reserved
		if used == 0 || used+cost <= d.limit {
			d.reserved += cost
			return nil
		}
		d.blocked++
		d.poke()
		d.cond.Wait()
		d.blocked--
	}
}

func (d *Device) unreserve(cost int64) {
	d.mu.Lock()
	d.reserved -= cost
	d.cond.Broadcast()
	d.mu.Unlock()
}

// poke wakes the committer without blocking.
func (d *Device) poke() {
	select {
	case d.kick <- struct{}{}:
	default:
	}
}

// waitDurable waits until batch seq is committed; if it is still pending, it asks for a
// commit now.
func (d *Device) waitDurable(seq uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.pending.seq == seq && !d.pending.empty() {
		d.urgent = true
		d.poke()
	}
	for d.durable < seq {
		if d.failed != nil {
			return d.failed
		}
		d.cond.Wait()
	}
	return nil
}

// getRecs returns scratch for n records.
func (d *Device) getRecs(n int) *[]record {
	rp := d.recPool.Get().(*[]record)
	if cap(*rp) < n {
		*rp = make([]record, d.pieceSectors)
	}
	*rp = (*rp)[:n]
	return rp
}

func (d *Device) putRecs(rp *[]record) { d.recPool.Put(rp) }

package blockdev

import (
	"fmt"
	"time"

	"github.com/elidisk/eli/provider"
)

// committer is the one goroutine that commits batches, in order, one at a time. A batch is
// committed when it is due: a Flush or FUA write waits for it, writers wait for room, it
// reached CommitBytes, CommitInterval passed since its first write, or Close.
func (d *Device) committer() {
	defer close(d.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		d.mu.Lock()
		for {
			if d.failed != nil {
				d.mu.Unlock()
				return
			}
			b := d.pending
			if !b.empty() {
				wait := d.interval - time.Duration(d.now()-b.first)
				if d.urgent || d.stopping || d.blocked > 0 || b.cost() >= d.commitBytes || wait <= 0 {
					break
				}
				timer.Reset(wait)
			} else if d.stopping {
				d.mu.Unlock()
				return
			}
			d.mu.Unlock()
			select {
			case <-d.kick:
			case <-timer.C:
			}
			d.mu.Lock()
		}
		b := d.pending
		d.pending = d.newBatchLocked(b.seq + 1)
		d.committing = b
		d.started = b.seq
		d.urgent = false
		d.cond.Broadcast() // writers waiting for room
		d.mu.Unlock()

		d.commitMu.Lock()
		start := time.Now()
		d.syncTime = 0
		err := d.commit(b)
		took := time.Since(start)
		d.commitMu.Unlock()

		d.mu.Lock()
		if err != nil {
			// The provider failed mid-commit: what is on it is for recovery to sort out at
			// the next attach. The batch stays visible, so reads stay consistent, and every
			// later write or flush fails.
			d.failed = fmt.Errorf("commit of batch %d failed, device stopped (reattach to recover): %w", b.seq, err)
			d.log.Error("commit failed; the device accepts no more writes", "batch", b.seq, "err", err)
			d.cond.Broadcast()
			d.mu.Unlock()
			return
		}
		d.committing = nil
		d.adaptLimit(b.bytes, took, d.syncTime)
		d.durable = b.seq
		d.cond.Broadcast()
		b.entries.reset(d.slabs)
		b.bytes = 0
		d.spare = b
		d.mu.Unlock()
	}
}

// timedSync is sync for the commit path (and recovery), adding its duration to syncTime.
func (d *Device) timedSync() error {
	start := time.Now()
	err := d.sync()
	d.syncTime += time.Since(start)
	return err
}

// adaptLimit sets how far the pending batch may grow (limit, between batchFloor and
// MaxBatchBytes) from the commit of bytes that just took took, syncTime of it syncing.
// Larger batches only pay for themselves where syncs are slow: a commit writes its data
// at some speed w and waits about syncTime regardless of size, so a batch of 9·syncTime·w
// keeps the syncs to a tenth of the time. Where they are quick (tmpfs, a disk with a
// write cache), batches stay small, and so does the memory they cycle through: sealing
// into a 4 MiB ring runs at 3.4 GB/s, into a 64 MiB one at 2.95 (one Zen 4 core,
// sector's BenchmarkSealRunDestination); on /dev/shm a 4 rather than 16 MiB bound took
// writes from 3.3–3.55 to 3.75–3.8 GB/s.
func (d *Device) adaptLimit(bytes int64, took, syncTime time.Duration) {
	want := d.maxBatch
	if busy := took - syncTime; busy > 0 {
		want = int64(9 * float64(bytes) * float64(syncTime) / float64(busy))
	}
	d.limit = min(d.maxBatch, max(d.batchFloor, want))
}

func (d *Device) newBatchLocked(seq uint64) *batch {
	b := d.spare
	d.spare = nil
	if b == nil {
		b = &batch{}
	}
	b.seq = seq
	return b
}

// commit makes batch b durable: in rounds that fit both the journal and half the
// metadata cache, each one journal write, sync, in-place writes, sync.
func (d *Device) commit(b *batch) error {
	refs := b.entries.appendSorted(d.sortBuf[:0])
	d.sortBuf = refs
	jcap := journalCap(d.l)
	for len(refs) > 0 {
		n, groups := 0, 0
		var lastG uint64
		for n < len(refs) && n < jcap {
			g, _ := d.geo.groupOf(refs[n].i)
			if n == 0 || g != lastG {
				if groups == d.roundMax {
					break
				}
				groups++
				lastG = g
			}
			n++
		}
		if err := d.commitRound(refs[:n]); err != nil {
			return err
		}
		refs = refs[n:]
	}
	d.stats.commits.Add(1)
	return nil
}

// commitRound commits the sectors refs (sorted, distinct) of a batch.
func (d *Device) commitRound(refs []ref) error {
	// Pin the metadata blocks: they give the old records, and they are written whole.
	blocks := d.blocks[:0]
	defer func() {
		for _, blk := range blocks {
			d.cache.unpin(blk)
		}
		d.blocks = blocks[:0]
	}()
	jes, written := d.jentries[:0], d.written[:0]
	for _, r := range refs {
		i := r.i
		g, j := d.geo.groupOf(i)
		if len(blocks) == 0 || blocks[len(blocks)-1].g != g {
			blk, err := d.cache.get(g)
			if err != nil {
				return err
			}
			blocks = append(blocks, blk)
		}
		old := d.cache.record(blocks[len(blocks)-1], j)
		if old.isZero() && r.e.rec.isZero() {
			continue // trimming a sector that holds nothing changes nothing
		}
		jes = append(jes, journalEntry{index: i, old: old, new: r.e.rec})
		written = append(written, r)
	}
	d.jentries, d.written = jes, written
	if len(jes) == 0 {
		return nil
	}

	// 1. The journal, durable before anything is written in place.
	if err := d.writeJournal(jes); err != nil {
		return err
	}

	// 2. Data and records in place, in any order; recovery sorts out a crash in here.
	bi := 0
	for _, je := range jes {
		g, j := d.geo.groupOf(je.index)
		for blocks[bi].g != g {
			bi++
		}
		d.cache.patch(blocks[bi], j, &je.new)
	}
	if err := d.writeData(written); err != nil {
		return err
	}
	if err := d.writeBlocks(blocks); err != nil {
		return err
	}
	d.stats.rounds.Add(1)
	d.stats.sectors.Add(uint64(len(jes)))
	return nil
}

// writeJournal seals entries into the journal, writes it and syncs.
func (d *Device) writeJournal(entries []journalEntry) error {
	buf, err := d.jrnl.encode(entries)
	if err != nil {
		return err
	}
	if _, err := d.p.WriteAt(buf, d.l.JournalOffset()); err != nil {
		return fmt.Errorf("write journal: %w", err)
	}
	return d.timedSync()
}

// writeData writes the ciphertext of the round's sectors refs, one WriteAt per run of sectors
// that are adjacent both on the provider (same group) and in one slab, and punches the
// data of trimmed ones where the provider can. The runs, of at most ioPiece sectors, are
// written in parallel where the provider takes parallel writes: the kernel's copy into
// the page cache is a good part of a write's cost.
func (d *Device) writeData(refs []ref) error {
	puncher, _ := d.p.(provider.Puncher)
	s := d.s
	ops := d.dataOps[:0]
	defer func() { d.dataOps = ops }()
	for x := 0; x < len(refs); {
		i, e := refs[x].i, refs[x].e
		g, _ := d.geo.groupOf(i)
		y := x + 1
		for y < len(refs) && y-x < d.ioPiece {
			ni, ne := refs[y].i, refs[y].e
			ng, _ := d.geo.groupOf(ni)
			if ni != i+uint64(y-x) || ng != g || (ne.slab == nil) != (e.slab == nil) {
				break
			}
			if e.slab != nil && (ne.slab != e.slab || int(ne.off) != int(e.off)+(y-x)*s) {
				break
			}
			if e.slab == nil && ne.punch != e.punch {
				break
			}
			y++
		}
		op := dataOp{first: i, n: y - x, pos: d.geo.dataPos(i)}
		switch {
		case e.slab != nil:
			op.data = e.slab.buf[e.off : int(e.off)+(y-x)*s]
			ops = append(ops, op)
		case e.punch && puncher != nil:
			ops = append(ops, op)
		}
		x = y
	}
	do := func(ops []dataOp) error {
		for _, op := range ops {
			if op.data != nil {
				if _, err := d.p.WriteAt(op.data, op.pos); err != nil {
					return fmt.Errorf("write sectors %d-%d: %w", op.first, op.first+uint64(op.n-1), err)
				}
			} else if err := puncher.Punch(op.pos, int64(op.n*s)); err != nil {
				return fmt.Errorf("punch sectors %d-%d: %w", op.first, op.first+uint64(op.n-1), err)
			}
		}
		return nil
	}
	if d.serialWrites {
		// Parallel writes would wait for each other in the kernel (provider.SerialWriter),
		// and spin meanwhile: leave the other cores to seal the next batch.
		return do(ops)
	}
	return d.workers.run(len(ops), 1, func(lo, hi int) error { return do(ops[lo:hi]) })
}

// dataOp is one write (data) or punch (data nil) of n sectors from first, at pos.
type dataOp struct {
	first uint64
	n     int
	pos   int64
	data  []byte
}

// writeBlocks writes metadata blocks in place and syncs: the last step of a commit round
// and of recovery.
func (d *Device) writeBlocks(blocks []*mblock) error {
	for _, blk := range blocks {
		if _, err := d.p.WriteAt(blk.data, d.geo.blockPos(blk.g)); err != nil {
			return fmt.Errorf("write metadata block of group %d: %w", blk.g, err)
		}
	}
	return d.timedSync()
}

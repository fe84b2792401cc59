package blockdev

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/blockdev/internal/tree"
)

// Commits run one at a time, in order, in whichever goroutine finds one due: the
// committer goroutine, or a Flush or FUA write that finds no commit running (waitDurable).
// A flush that commits its own batch saves waking the committer and being woken back:
// on a VM, a third of the CPU time of a lone write and its flush on tmpfs
// (docs/benchmarks.md, "Measurements behind design choices"). running says that a
// goroutine is committing; the others wait for it.

// A commitJob is what is due next.
type commitJob int

const (
	jobNone   commitJob = iota
	jobCommit           // commit the pending batch
	jobMark             // write an empty journal slot that completes the last batch (version 2)
	jobExit             // the device failed, or is closing with nothing left to do
)

// nextJobLocked says what is due, and for jobNone how long until the pending batch's
// CommitInterval runs out (0: nothing pending). A batch is due when a Flush or FUA waits
// for it, writers wait for room, it reached CommitBytes, CommitInterval passed since its
// first write, or Close.
func (a *authEngine) nextJobLocked() (commitJob, time.Duration) {
	if a.failed != nil {
		return jobExit, 0
	}
	b := a.pending
	markDue := a.markDue()
	switch {
	case markDue && b.empty():
		return jobMark, 0
	case !b.empty():
		// A Flush waiting for a committed batch is served as soon by the pending
		// batch's first slot as by an empty one, and a sync cheaper.
		wait := a.interval - time.Duration(a.now()-b.first)
		if markDue || a.urgent || a.stopping || a.blocked > 0 || b.cost() >= a.commitBytes || wait <= 0 {
			return jobCommit, 0
		}
		return jobNone, wait
	case a.stopping && !a.running:
		return jobExit, 0
	}
	return jobNone, 0
}

// runLocked does job (jobCommit or jobMark) with a.mu held on entry and on return, and
// a.running set throughout. A failure stops the device (failLocked), which the callers
// find in a.failed.
func (a *authEngine) runLocked(job commitJob) {
	a.running = true
	defer func() {
		a.running = false
		a.cond.Broadcast() // flushes waiting for the runner to be done
		if a.deferred {
			a.deferred = false
			a.poke()
		}
	}()
	if job == jobMark {
		a.mu.Unlock()
		a.commitMu.Lock()
		err := a.markCompleted()
		a.commitMu.Unlock()
		a.mu.Lock()
		if err != nil {
			a.failLocked(a.committed, err)
		}
		return
	}
	b := a.pending
	a.pending = a.newBatchLocked(b.seq + 1)
	a.committing = b
	a.started = b.seq
	a.urgent = false
	a.cond.Broadcast() // writers waiting for room
	a.mu.Unlock()

	a.commitMu.Lock()
	start := time.Now()
	a.syncTime = 0
	gen := a.jrnl.gen
	err := a.commit(b)
	wroteSlot := a.jrnl.gen != gen
	took := time.Since(start)
	a.commitMu.Unlock()

	a.mu.Lock()
	if err != nil {
		// The batch stays visible, so reads stay consistent.
		a.failLocked(b.seq, err)
		return
	}
	a.committing = nil
	a.adaptLimit(b.bytes, took, a.syncTime)
	switch {
	case a.tree == nil:
		a.durable = b.seq
	case !wroteSlot && a.durable == a.committed:
		a.durable = b.seq // it changed nothing on the provider
	}
	// Otherwise b's first slot completed the batches before it (slotDurable), and b
	// waits for the next slot.
	a.committed = b.seq
	a.cond.Broadcast()
	b.entries.reset(a.slabs)
	b.bytes = 0
	a.spare = b
}

// committer is the goroutine that commits what no flush commits: batches that fill up or
// whose CommitInterval runs out, and what Close leaves.
//
// It is not woken for every batch: while writes come, it wakes every CommitInterval and
// arms its timer for the pending batch's deadline, so a writer whose batch a flush
// commits never wakes it. After idleTicks intervals with nothing pending it sleeps until
// the next batch's first write pokes it (asleep).
func (a *authEngine) committer() {
	defer close(a.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	idle := 0
	a.mu.Lock()
	for {
		job, wait := a.nextJobLocked()
		switch {
		case job == jobExit:
			a.mu.Unlock()
			return
		case job != jobNone && !a.running:
			a.runLocked(job) // a failure is jobExit next
			idle = 0
			continue
		case job != jobNone || (a.stopping && a.running):
			// Another goroutine commits; it pokes when done.
			a.deferred = true
		case wait > 0:
			idle = 0
			timer.Reset(wait)
		case idle < idleTicks:
			idle++
			timer.Reset(a.interval)
		default:
			a.asleep = true
		}
		a.waits++
		a.mu.Unlock()
		select {
		case <-a.kick:
		case <-timer.C:
		}
		a.mu.Lock()
		a.asleep = false
		a.wakes++
	}
}

// idleTicks is how many CommitIntervals the committer waits with nothing pending before
// it sleeps until poked.
const idleTicks = 10

// failLocked stops the device after the provider failed in the commit of batch seq (or
// in the slot that completes it): what is on the provider is for recovery to sort out at
// the next attach, and every later write or flush fails.
func (a *authEngine) failLocked(seq uint64, err error) {
	a.failed = fmt.Errorf("commit of batch %d failed, device stopped (reattach to recover): %w", seq, err)
	a.log.Error("commit failed; the device accepts no more writes", "batch", seq, "err", err)
	a.cond.Broadcast()
}

// markDue reports whether a Flush or FUA waits for a committed batch that no later journal
// slot completes yet (version 2).
func (a *authEngine) markDue() bool {
	return a.tree != nil && a.durable < a.wantDurable && a.wantDurable <= a.committed
}

// slotDurable is called once a commit round's journal slot is durable (version 2): the
// slot completes the rounds before it, so the batches committed before this one may be
// acknowledged, and its generation is what the witness may record.
func (a *authEngine) slotDurable() {
	a.setFresh()
	a.mu.Lock()
	if a.durable < a.committed {
		a.durable = a.committed
		a.cond.Broadcast()
	}
	a.mu.Unlock()
}

// markCompleted writes an empty journal slot, the next generation with the same root, and
// syncs: the last round's slot, which names its sectors' old records, is no longer the
// current one, so recovery can no longer take those records back, whatever was put back
// in the data area. A Flush (and the witness it reports to) waits for this. Without it, a
// crash after the flush would leave the round's old records one step from being chosen:
// put back a sector's old ciphertext and recovery, finding that it opens with the old
// record, would serve the old data (TestFreshnessLastRoundAfterCrash).
func (a *authEngine) markCompleted() error {
	if err := a.writeJournal2(nil); err != nil {
		return err
	}
	a.slotDurable()
	return nil
}

// timedSync is sync for the commit path (and recovery), adding its duration to syncTime.
func (a *authEngine) timedSync() error {
	start := time.Now()
	err := a.sync()
	a.syncTime += time.Since(start)
	return err
}

// adaptLimit sets how far the pending batch may grow (limit, between batchFloor and
// MaxBatchBytes) from the commit of bytes that just took took, syncTime of it syncing.
// Larger batches only pay for themselves where syncs are slow: a commit writes its data
// at some speed w and waits about syncTime regardless of size, so a batch of 9·syncTime·w
// keeps the syncs to a tenth of the time. Where they are quick (tmpfs, a disk with a
// write cache), batches stay small, and so does the memory they cycle through: sealing
// into a small ring that stays in cache is faster than into a large one, and so are the
// device's writes with a small bound (docs/benchmarks.md, "Measurements behind design
// choices").
func (a *authEngine) adaptLimit(bytes int64, took, syncTime time.Duration) {
	if a.concurrentIO() {
		// Over a network provider every step of a commit is a round trip, the writes'
		// as much as the syncs': all of a commit's time but the transfer is fixed cost.
		a.limit = a.maxBatch
		return
	}
	want := a.maxBatch
	if busy := took - syncTime; busy > 0 {
		want = int64(9 * float64(bytes) * float64(syncTime) / float64(busy))
	}
	a.limit = min(a.maxBatch, max(a.batchFloor, want))
}

func (a *authEngine) newBatchLocked(seq uint64) *batch {
	b := a.spare
	a.spare = nil
	if b == nil {
		b = &batch{}
	}
	b.seq = seq
	return b
}

// commit makes batch b durable: in rounds that fit both the journal and half the
// metadata cache, each one journal write, sync, in-place writes, sync.
//
// Why this is crash safe: data is written in place only after the journal naming its
// sector's old and new record is durable, so after a crash at any instant recovery finds
// each sector with old or new data and old, new or torn record, and the journal tells it
// which record matches (docs/format.md, "Journal"). What was acknowledged before a
// completed Flush, or with FUA, was in a batch whose commit completed. crash_test.go
// checks this at every point of recorded workloads, with writes lost or torn.
func (a *authEngine) commit(b *batch) error {
	refs := b.entries.appendSorted(a.sortBuf[:0])
	a.sortBuf = refs
	jcap := journalCap(a.l)
	for len(refs) > 0 {
		n, groups := 0, 0
		var lastG uint64
		for n < len(refs) && n < jcap {
			g, _ := a.geo.groupOf(refs[n].i)
			if n == 0 || g != lastG {
				if groups == a.roundMax {
					break
				}
				groups++
				lastG = g
			}
			n++
		}
		if err := a.commitRound(refs[:n]); err != nil {
			return err
		}
		refs = refs[n:]
	}
	a.stats.commits.Add(1)
	return nil
}

// commitRound commits the sectors refs (sorted, distinct) of a batch.
func (a *authEngine) commitRound(refs []ref) error {
	// Pin the metadata blocks: they give the old records, and they are written whole.
	blocks := a.blocks[:0]
	defer func() {
		for _, blk := range blocks {
			a.cache.unpin(blk)
		}
		a.blocks = blocks[:0]
	}()
	if a.concurrentIO() {
		a.prefetch(refs)
	}
	jes, written := a.jentries[:0], a.written[:0]
	for _, r := range refs {
		i := r.i
		g, j := a.geo.groupOf(i)
		if len(blocks) == 0 || blocks[len(blocks)-1].g != g {
			blk, err := a.cache.get(g)
			if err != nil {
				return err
			}
			blocks = append(blocks, blk)
		}
		old := a.cache.record(blocks[len(blocks)-1], j)
		if old.isZero() && r.e.rec.isZero() {
			continue // trimming a sector that holds nothing changes nothing
		}
		jes = append(jes, journalEntry{index: i, old: old, new: r.e.rec})
		written = append(written, r)
	}
	a.jentries, a.written = jes, written
	if len(jes) == 0 {
		return nil
	}

	var tc *tree.Commit
	if a.tree == nil {
		// 1. The journal, durable before anything is written in place.
		if err := a.writeJournal(jes); err != nil {
			return err
		}
		a.patchRound(blocks, jes, nil)
	} else {
		// Version 2: the journal carries the root the round produces, so the records
		// go into the cached blocks first (readers of other sectors of these blocks see
		// no change; the round's sectors are read from the committing batch), each
		// block is hashed once over the pieces they touched, and the tree is updated.
		leaves := a.patchRound(blocks, jes, a.leaves[:0])
		a.leaves = leaves
		var err error
		if tc, err = a.tree.Update(leaves); err != nil {
			return fmt.Errorf("update hash tree: %w", err)
		}
		if err := a.writeJournal2(jes); err != nil {
			return err
		}
		a.slotDurable()
	}

	// 2. Data, records and tree nodes in place, in any order; recovery sorts out a crash
	// in here.
	if a.concurrentIO() {
		if err := a.writeInPlace(written, blocks, tc); err != nil {
			return err
		}
	} else {
		if err := a.writeData(written); err != nil {
			return err
		}
		if err := a.writeBlocks(blocks, tc); err != nil {
			return err
		}
	}
	if tc != nil {
		a.tree.Written(tc)
	}
	a.stats.rounds.Add(1)
	a.stats.sectors.Add(uint64(len(jes)))
	return nil
}

// patchRound puts the round's new records into its pinned blocks. In version 2 it appends
// to leaves the new digest of every block it changed.
func (a *authEngine) patchRound(blocks []*mblock, jes []journalEntry, leaves []tree.Leaf) []tree.Leaf {
	hashed := a.cache.hashed
	bi := 0
	touched := false
	start := len(leaves)
	for _, je := range jes {
		g, j := a.geo.groupOf(je.index)
		for blocks[bi].g != g {
			if touched && hashed {
				leaves = append(leaves, tree.Leaf{Index: uint64(bi)})
			}
			bi++
			touched = false
		}
		a.cache.patch(blocks[bi], j, &je.new)
		touched = true
	}
	if touched && hashed {
		leaves = append(leaves, tree.Leaf{Index: uint64(bi)})
	}
	// The digests, in parallel where there are many: a commit waits for them before it
	// can write its journal, and clients waiting for a flush leave the other cores idle.
	changed := leaves[start:]
	a.workers.run(len(changed), digestChunk, func(lo, hi int) error {
		for k := lo; k < hi; k++ {
			blk := blocks[changed[k].Index]
			changed[k] = tree.Leaf{Index: blk.g, Digest: a.cache.digest(blk)}
		}
		return nil
	})
	return leaves
}

// digestChunk is how many blocks' digests a worker takes at once: each costs about a
// microsecond, handing work to another thread several on a VM.
const digestChunk = 16

// writeJournal seals entries into the journal, writes it and syncs.
func (a *authEngine) writeJournal(entries []journalEntry) error {
	buf, err := a.jrnl.encode(entries)
	if err != nil {
		return err
	}
	if err := a.writeTearable(buf, a.l.JournalOffset()); err != nil {
		return fmt.Errorf("write journal: %w", err)
	}
	return a.timedSync()
}

// writeData writes the ciphertext of the round's sectors refs, one WriteAt per run of sectors
// that are adjacent both on the provider (same group) and in one slab, and punches the
// data of trimmed ones where the provider can. The runs, of at most ioPiece sectors, are
// written in parallel where the provider takes parallel writes: the kernel's copy into
// the page cache is a good part of a write's cost.
func (a *authEngine) writeData(refs []ref) error {
	puncher := a.puncher
	s := a.s
	ops := a.dataOps[:0]
	defer func() { a.dataOps = ops }()
	for x := 0; x < len(refs); {
		i, e := refs[x].i, refs[x].e
		g, _ := a.geo.groupOf(i)
		y := x + 1
		for y < len(refs) && y-x < a.ioPiece {
			ni, ne := refs[y].i, refs[y].e
			ng, _ := a.geo.groupOf(ni)
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
		op := dataOp{first: i, n: y - x, pos: a.geo.dataPos(i)}
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
				if _, err := a.p.WriteAt(op.data, op.pos); err != nil {
					return fmt.Errorf("write sectors %d-%d: %w", op.first, op.first+uint64(op.n-1), err)
				}
			} else if err := puncher.Punch(op.pos, int64(op.n*s)); err != nil {
				return fmt.Errorf("punch sectors %d-%d: %w", op.first, op.first+uint64(op.n-1), err)
			}
		}
		return nil
	}
	if a.concurrentIO() {
		return eachConcurrently(len(ops), func(k int) error { return do(ops[k : k+1]) })
	}
	if a.caps.SerialWrites {
		// Parallel writes would wait for each other in the kernel (provider.SerialWriter),
		// and spin meanwhile: leave the other cores to seal the next batch.
		return do(ops)
	}
	return a.workers.run(len(ops), 1, func(lo, hi int) error { return do(ops[lo:hi]) })
}

// dataOp is one write (data) or punch (data nil) of n sectors from first, at pos.
type dataOp struct {
	first uint64
	n     int
	pos   int64
	data  []byte
}

// writeBlocks writes metadata blocks and the tree nodes of commits (version 2; later
// commits' nodes after earlier ones') in place and syncs: the last step of a commit round
// and of recovery.
func (a *authEngine) writeBlocks(blocks []*mblock, commits ...*tree.Commit) error {
	if a.concurrentIO() {
		if err := eachConcurrently(len(blocks), func(k int) error { return a.writeBlock(blocks[k]) }); err != nil {
			return err
		}
	} else {
		for _, blk := range blocks {
			if err := a.writeBlock(blk); err != nil {
				return err
			}
		}
	}
	if err := a.writeNodes(commits); err != nil {
		return err
	}
	return a.timedSync()
}

// writeBlock writes a metadata block in place. Copied into a mapping, only the bytes
// patched since its last write go: a lone random write changes one record of a block,
// and the provider already holds the rest (a torn copy tears only records that the
// journal names, or bytes that it rewrites with their own value).
//
// A block's first pwritesBeforeMapping writes since it was loaded go by system call
// instead: the first write through the mapping faults the page in, which on a VM costs
// several pwrites, and a sequential load writes most blocks only once or twice, where
// random writes write a block again and again.
func (a *authEngine) writeBlock(blk *mblock) error {
	pos := a.geo.blockPos(blk.g)
	var done bool
	var err error
	if lo, hi := blk.wlo, blk.whi; a.mapped != nil && hi > lo && blk.writes >= a.blockPwrites {
		done, err = a.mapped.WriteMapped(blk.data[lo:hi], pos+int64(lo))
	}
	if !done {
		_, err = a.p.WriteAt(blk.data, pos)
	}
	if err != nil {
		return fmt.Errorf("write metadata block of group %d: %w", blk.g, err)
	}
	blk.wlo, blk.whi = 0, 0
	blk.writes = min(blk.writes+1, a.blockPwrites)
	return nil
}

// pwritesBeforeMapping is how many times writeBlock writes a block by system call before
// it copies it into the mapping.
const pwritesBeforeMapping = 4

// writeNodes writes the tree nodes of commits in place, a later commit's version of a node
// over an earlier one's, and nodes that lie next to each other (the first node of every
// level, at the start of the data area) in one write.
func (a *authEngine) writeNodes(commits []*tree.Commit) error {
	type nodeOp struct {
		pos  int64
		data []byte
	}
	ops := make([]nodeOp, 0, 16)
	seen := make(map[int64]int)
	for _, c := range commits {
		if c == nil {
			continue
		}
		for _, n := range c.Nodes {
			pos := a.l.NodePos(n.Level, n.Index)
			if k, ok := seen[pos]; ok {
				ops[k].data = n.Data
				continue
			}
			seen[pos] = len(ops)
			ops = append(ops, nodeOp{pos, n.Data})
		}
	}
	slices.SortFunc(ops, func(x, y nodeOp) int { return cmp.Compare(x.pos, y.pos) })
	for x := 0; x < len(ops); {
		y := x + 1
		for y < len(ops) && ops[y].pos == ops[y-1].pos+layout.NodeSize {
			y++
		}
		buf := ops[x].data
		if y-x > 1 {
			buf = a.nodeBuf[:0]
			for _, op := range ops[x:y] {
				buf = append(buf, op.data...)
			}
			a.nodeBuf = buf
		}
		if err := a.writeTearable(buf, ops[x].pos); err != nil {
			return fmt.Errorf("write tree nodes at %d: %w", ops[x].pos, err)
		}
		x = y
	}
	return nil
}

// writeTearable writes what recovery accepts torn at any byte, not only whole atomic
// units: the journal (its seal fails if torn, and a torn journal was never synced, so
// nothing of its round was written in place), metadata blocks and tree nodes (the
// journal names the old and new record of every sector whose record changes, and
// recovery rewrites them and rebuilds the nodes above them). Where the provider can, it
// copies them into a mapping instead of making a system call: on tmpfs that takes most
// of the cost of a lone random write's metadata off it (docs/benchmarks.md).
func (c *core) writeTearable(b []byte, off int64) error {
	if c.mapped != nil {
		if ok, err := c.mapped.WriteMapped(b, off); ok {
			return err
		}
	}
	_, err := c.p.WriteAt(b, off)
	return err
}

// readOnce reads what a cache will keep (a metadata block, a tree node): by system call
// where the provider would read through a mapping, whose first touch of a page costs
// more than the read (provider.OnceReader).
func (c *core) readOnce(b []byte, off int64) error {
	var err error
	if c.once != nil {
		_, err = c.once.ReadOnce(b, off)
	} else {
		_, err = c.p.ReadAt(b, off)
	}
	return err
}

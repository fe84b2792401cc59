package blockdev

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/blockdev/internal/tree"
)

// committer runs the commits of an authenticated engine's batches (batch.go): when, in
// which goroutine, and how. Commits run one at a time, in order, in whichever goroutine
// finds one due: the committer goroutine (loop), or a Flush or FUA write that finds no
// commit running (waitDurable). A flush that commits its own batch saves waking the
// committer and being woken back, a large share of what a lone write and its flush cost
// where waking a thread is dear (a VM): BenchmarkWriteFlush measures it
// (docs/benchmarks.md, "Measurements behind design choices").
//
// A commit writes each round's journal, syncs, writes data, records and tree nodes in
// place and syncs (commit); what a format version adds to a round, its freshness does
// (fresh.go).
type committer struct {
	*core
	b     *batcher
	cache *metaCache
	jrnl  *journal
	fresh freshness
	wake  wakeup
	done  chan struct{} // closed when loop returns

	interval time.Duration // Config.CommitInterval
	roundMax int           // distinct groups per commit round (metadata blocks pinned at once)
	// blockPwrites: a metadata block's writes by system call before writeBlock copies it
	// into a mapping (pwritesBeforeMapping; the crash tests lower it).
	blockPwrites int

	// Guarded by b.mu.
	running  bool // a goroutine is committing (runLocked)
	deferred bool // the committer found work while running: poke it when done
	stopping bool // Close: commit what is pending, then exit
	// For tests: how often the committer went to wait and woke, and how many jobs
	// flushes ran.
	waits, wakes, flushJobs uint64

	commitMu sync.Mutex // held for a whole commit
	// State of the goroutine that is running a commit (under commitMu).
	syncTime time.Duration // spent in syncs by the commit under way
	scratch  commitScratch
}

// commitScratch is what a commit reuses from one to the next, so that a steady load
// allocates nothing.
type commitScratch struct {
	dataOps  []dataOp
	sortBuf  []ref // a batch's sectors in index order
	jentries []journalEntry
	written  []ref // the sectors of jentries
	blocks   []*mblock
	leaves   []tree.Leaf
	nodeBuf  []byte // adjacent tree nodes, written as one
}

// wakeup is how writers wake the committer goroutine: a poke, which never blocks and
// coalesces with one not yet taken. Guarded by the batcher's mu.
type wakeup struct {
	kick   chan struct{} // nil on a read-only device, which has no committer
	asleep bool          // the committer waits for a poke, no timer armed
}

// poke wakes the committer without blocking.
func (w *wakeup) poke() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// pokeIfAsleep wakes the committer if no timer will: the first write of a batch calls it.
func (w *wakeup) pokeIfAsleep() {
	if w.asleep {
		w.asleep = false
		w.poke()
	}
}

// init sets c up for cfg, with its parts; start starts its goroutine.
func (c *committer) init(core *core, b *batcher, cache *metaCache, jrnl *journal, fresh freshness, cfg Config) {
	c.core, c.b, c.cache, c.jrnl, c.fresh = core, b, cache, jrnl, fresh
	c.interval = cfg.CommitInterval
	if c.interval <= 0 {
		c.interval = DefaultCommitInterval
	}
	// A round pins its metadata blocks, so it may use half of the cache; the other half
	// keeps serving readers.
	c.roundMax = max(1, cache.capacity()/2)
	c.blockPwrites = pwritesBeforeMapping
}

func (c *committer) start() {
	c.wake.kick = make(chan struct{}, 1)
	c.done = make(chan struct{})
	go c.loop()
}

// stop has the committer goroutine commit what is pending and exit, and returns the
// failure that stopped the device, if one did.
func (c *committer) stop() error {
	c.b.mu.Lock()
	c.stopping = true
	c.b.mu.Unlock()
	c.wake.poke()
	<-c.done
	c.b.mu.Lock()
	defer c.b.mu.Unlock()
	return c.b.failed
}

// hold keeps the next commit from starting its writes until release: a reader's last
// attempt (read.go) holds it, so that it cannot starve behind a stream of commits.
func (c *committer) hold()    { c.commitMu.Lock() }
func (c *committer) release() { c.commitMu.Unlock() }

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
func (c *committer) nextJobLocked() (commitJob, time.Duration) {
	b := c.b
	if b.failed != nil {
		return jobExit, 0
	}
	p := b.pending
	switch {
	case p.empty() && b.markDueLocked():
		return jobMark, 0
	case !p.empty():
		// A Flush waiting for a committed batch is served as soon by the pending
		// batch's first slot as by an empty one, and a sync cheaper.
		wait := c.interval - time.Duration(b.now()-p.first)
		if c.stopping || wait <= 0 || b.dueLocked() {
			return jobCommit, 0
		}
		return jobNone, wait
	case c.stopping && !c.running:
		return jobExit, 0
	}
	return jobNone, 0
}

// runLocked does job (jobCommit or jobMark) with b.mu held on entry and on return, and
// c.running set throughout. A failure stops the device (failLocked), which the callers
// find in b.failed.
func (c *committer) runLocked(job commitJob) {
	c.running = true
	defer func() {
		c.running = false
		c.b.cond.Broadcast() // flushes waiting for the runner to be done
		if c.deferred {
			c.deferred = false
			c.wake.poke()
		}
	}()
	if job == jobMark {
		c.b.mu.Unlock()
		c.commitMu.Lock()
		err := c.markCompleted()
		c.commitMu.Unlock()
		c.b.mu.Lock()
		if err != nil {
			c.failLocked(c.b.committed, err)
		}
		return
	}
	b := c.b.beginLocked()
	c.b.mu.Unlock()

	c.commitMu.Lock()
	start := time.Now()
	c.syncTime = 0
	gen := c.jrnl.gen
	err := c.commit(b)
	wroteSlot := c.jrnl.gen != gen
	took, synced := time.Since(start), c.syncTime // commitMu's: whoever holds it next may sync
	c.commitMu.Unlock()

	c.b.mu.Lock()
	if err != nil {
		// The batch stays visible, so reads stay consistent.
		c.failLocked(b.seq, err)
		return
	}
	c.b.adaptLimit(b.bytes, took, synced)
	c.b.endLocked(b, wroteSlot)
}

// loop is the committer goroutine, which commits what no flush commits: batches that
// fill up or whose CommitInterval runs out, and what Close leaves.
//
// It is not woken for every batch: while writes come, it wakes every CommitInterval and
// arms its timer for the pending batch's deadline, so a writer whose batch a flush
// commits never wakes it. After idleTicks intervals with nothing pending it sleeps until
// the next batch's first write pokes it (asleep).
func (c *committer) loop() {
	defer close(c.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	idle := 0
	c.b.mu.Lock()
	for {
		job, wait := c.nextJobLocked()
		switch {
		case job == jobExit:
			c.b.mu.Unlock()
			return
		case job != jobNone && !c.running:
			c.runLocked(job) // a failure is jobExit next
			idle = 0
			continue
		case job != jobNone || (c.stopping && c.running):
			// Another goroutine commits; it pokes when done.
			c.deferred = true
		case wait > 0:
			idle = 0
			timer.Reset(wait)
		case idle < idleTicks:
			idle++
			timer.Reset(c.interval)
		default:
			c.wake.asleep = true
		}
		c.waits++
		c.b.mu.Unlock()
		select {
		case <-c.wake.kick:
		case <-timer.C:
		}
		c.b.mu.Lock()
		c.wake.asleep = false
		c.wakes++
	}
}

// idleTicks is how many CommitIntervals the committer waits with nothing pending before
// it sleeps until poked.
const idleTicks = 10

// waitDurable waits until batch seq is durable; if it is still pending, it asks for a
// commit now, and makes it itself when no commit is running.
func (c *committer) waitDurable(seq uint64) error {
	b := c.b
	b.mu.Lock()
	defer b.mu.Unlock()
	b.wantLocked(seq)
	for b.durable < seq {
		if b.failed != nil {
			return b.failed
		}
		if !c.running {
			if job, _ := c.nextJobLocked(); job == jobCommit || job == jobMark {
				c.flushJobs++
				c.runLocked(job)
				continue
			}
		}
		b.cond.Wait()
	}
	return nil
}

// failLocked stops the device after the provider failed in the commit of batch seq (or
// in the slot that completes it): what is on the provider is for recovery to sort out at
// the next attach, and every later write or flush fails.
func (c *committer) failLocked(seq uint64, err error) {
	c.log.Error("commit failed; the device accepts no more writes", "batch", seq, "err", err)
	c.b.failLocked(fmt.Errorf("commit of batch %d failed, device stopped (reattach to recover): %w", seq, err))
}

// slotDurable is called once a journal write is durable. In version 2 the slot completes
// the rounds before it, so the batches committed before this one may be acknowledged,
// and its generation is what the witness may record; in version 1 no batch waits for it.
func (c *committer) slotDurable() {
	c.fresh.slotDurable()
	c.b.mu.Lock()
	c.b.completeLocked()
	c.b.mu.Unlock()
}

// markCompleted writes an empty journal slot, the next generation with the same root, and
// syncs: the last round's slot, which names its sectors' old records, is no longer the
// current one, so recovery can no longer take those records back, whatever was put back
// in the data area. A Flush (and the witness it reports to) waits for this. Without it, a
// crash after the flush would leave the round's old records one step from being chosen:
// put back a sector's old ciphertext and recovery, finding that it opens with the old
// record, would serve the old data (TestFreshnessLastRoundAfterCrash).
func (c *committer) markCompleted() error {
	if err := c.writeJournal(nil); err != nil {
		return err
	}
	c.slotDurable()
	return nil
}

// markCompletedNow is markCompleted for the device's own steps, outside the committer's
// jobs (a suspend, the end of a re-encryption's sweep), with the committer held. A
// failure stops the device as a failed commit does (runLocked): the slot's generation is
// taken and the slot may be torn on the provider, so in version 2 the next journal write
// would go over the other slot, the only one that holds the current root, and a crash
// during it would leave no slot that opens (TestFailedEmptySlotStopsWrites).
func (c *committer) markCompletedNow() error {
	c.hold()
	err := c.markCompleted()
	c.release()
	if err != nil {
		c.b.mu.Lock()
		c.failLocked(c.b.committed, err)
		c.b.mu.Unlock()
	}
	return err
}

// timedSync is sync for the commit path (and recovery), adding its duration to syncTime.
func (c *committer) timedSync() error {
	start := time.Now()
	err := c.sync()
	c.syncTime += time.Since(start)
	return err
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
func (c *committer) commit(b *batch) error {
	refs := b.entries.appendSorted(c.scratch.sortBuf[:0])
	c.scratch.sortBuf = refs
	jcap := journalCap(c.l)
	for len(refs) > 0 {
		n, groups := 0, 0
		var lastG uint64
		for n < len(refs) && n < jcap {
			g, _ := c.geo.groupOf(refs[n].i)
			if n == 0 || g != lastG {
				if groups == c.roundMax {
					break
				}
				groups++
				lastG = g
			}
			n++
		}
		if err := c.commitRound(refs[:n]); err != nil {
			return err
		}
		refs = refs[n:]
	}
	c.stats.commits.Add(1)
	return nil
}

// commitRound commits the sectors refs (sorted, distinct) of a batch.
func (c *committer) commitRound(refs []ref) error {
	// Pin the metadata blocks: they give the old records, and they are written whole.
	blocks := c.scratch.blocks[:0]
	defer func() {
		for _, blk := range blocks {
			c.cache.unpin(blk)
		}
		c.scratch.blocks = blocks[:0]
	}()
	if c.concurrentIO() {
		c.prefetch(refs)
	}
	jes, written := c.scratch.jentries[:0], c.scratch.written[:0]
	for _, r := range refs {
		i := r.i
		g, j := c.geo.groupOf(i)
		if len(blocks) == 0 || blocks[len(blocks)-1].g != g {
			blk, err := c.cache.get(g)
			if err != nil {
				return err
			}
			blocks = append(blocks, blk)
		}
		old := c.cache.record(blocks[len(blocks)-1], j)
		if old.isZero() && r.e.rec.isZero() {
			continue // trimming a sector that holds nothing changes nothing
		}
		jes = append(jes, journalEntry{index: i, old: old, new: r.e.rec})
		written = append(written, r)
	}
	c.scratch.jentries, c.scratch.written = jes, written
	if len(jes) == 0 {
		return nil
	}

	// 1. The journal, durable before anything is written in place. In version 2 it
	// carries the root the round produces, so the records go into the cached blocks
	// first (readers of other sectors of these blocks see no change; the round's sectors
	// are read from the committing batch), each block is hashed once over the pieces
	// they touched, and the tree is updated.
	leaves := c.patchRound(blocks, jes, c.scratch.leaves[:0])
	c.scratch.leaves = leaves
	tc, err := c.fresh.update(leaves)
	if err != nil {
		return err
	}
	if err := c.writeJournal(jes); err != nil {
		return err
	}
	c.slotDurable()

	// 2. Data, records and tree nodes in place, in any order; recovery sorts out a crash
	// in here.
	if c.concurrentIO() {
		if err := c.writeInPlace(written, blocks, tc); err != nil {
			return err
		}
	} else {
		if err := c.writeData(written); err != nil {
			return err
		}
		if err := c.writeBlocks(blocks, tc); err != nil {
			return err
		}
	}
	c.fresh.written(tc)
	c.stats.rounds.Add(1)
	c.stats.sectors.Add(uint64(len(jes)))
	return nil
}

// patchRound puts the round's new records into its pinned blocks. Where the cache keeps
// digests (version 2), it appends to leaves the new digest of every block it changed.
func (c *committer) patchRound(blocks []*mblock, jes []journalEntry, leaves []tree.Leaf) []tree.Leaf {
	hashed := c.cache.hashed
	bi := 0
	touched := false
	start := len(leaves)
	for _, je := range jes {
		g, j := c.geo.groupOf(je.index)
		for blocks[bi].g != g {
			if touched && hashed {
				leaves = append(leaves, tree.Leaf{Index: uint64(bi)})
			}
			bi++
			touched = false
		}
		c.cache.patch(blocks[bi], j, &je.new)
		touched = true
	}
	if touched && hashed {
		leaves = append(leaves, tree.Leaf{Index: uint64(bi)})
	}
	// The digests, in parallel where there are many: a commit waits for them before it
	// can write its journal, and clients waiting for a flush leave the other cores idle.
	changed := leaves[start:]
	c.workers.run(len(changed), digestChunk, func(lo, hi int) error {
		for k := lo; k < hi; k++ {
			blk := blocks[changed[k].Index]
			changed[k] = tree.Leaf{Index: blk.g, Digest: c.cache.digest(blk)}
		}
		return nil
	})
	return leaves
}

// digestChunk is how many blocks' digests a worker takes at once: one digest (tree's
// BenchmarkBlockDigest) costs a fraction of handing work to another thread on a VM
// (docs/benchmarks.md, "Measurements behind design choices").
const digestChunk = 16

// writeJournal seals entries into the next journal write (in version 2 the next
// generation's slot, with the tree's current root), writes it and syncs.
func (c *committer) writeJournal(entries []journalEntry) error {
	buf, off, err := c.jrnl.encode(entries, c.fresh.root())
	if err != nil {
		return err
	}
	if err := c.writeTearable(buf, off); err != nil {
		return fmt.Errorf("write journal: %w", err)
	}
	return c.timedSync()
}

// writeData writes the ciphertext of the round's sectors refs, one WriteAt per run of sectors
// that are adjacent both on the provider (same group) and in one slab, and punches the
// data of trimmed ones where the provider can. The runs, of at most ioPiece sectors, are
// written in parallel where the provider takes parallel writes: the kernel's copy into
// the page cache is a good part of a write's cost.
func (c *committer) writeData(refs []ref) error {
	puncher := c.caps.Punch
	s := c.s
	ops := c.scratch.dataOps[:0]
	defer func() { c.scratch.dataOps = ops }()
	for x := 0; x < len(refs); {
		i, e := refs[x].i, refs[x].e
		g, _ := c.geo.groupOf(i)
		y := x + 1
		for y < len(refs) && y-x < c.ioPiece {
			ni, ne := refs[y].i, refs[y].e
			ng, _ := c.geo.groupOf(ni)
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
		op := dataOp{first: i, n: y - x, pos: c.geo.dataPos(i)}
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
				if _, err := c.p.WriteAt(op.data, op.pos); err != nil {
					return fmt.Errorf("write sectors %d-%d: %w", op.first, op.first+uint64(op.n-1), err)
				}
			} else if err := puncher(op.pos, int64(op.n*s)); err != nil {
				return fmt.Errorf("punch sectors %d-%d: %w", op.first, op.first+uint64(op.n-1), err)
			}
		}
		return nil
	}
	if c.concurrentIO() {
		return eachConcurrently(len(ops), func(k int) error { return do(ops[k : k+1]) })
	}
	if c.caps.SerialWrites {
		// Parallel writes would wait for each other in the kernel
		// (provider.Capabilities.SerialWrites),
		// and spin meanwhile: leave the other cores to seal the next batch.
		return do(ops)
	}
	return c.workers.run(len(ops), 1, func(lo, hi int) error { return do(ops[lo:hi]) })
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
func (c *committer) writeBlocks(blocks []*mblock, commits ...*tree.Commit) error {
	if c.concurrentIO() {
		if err := eachConcurrently(len(blocks), func(k int) error { return c.writeBlock(blocks[k]) }); err != nil {
			return err
		}
	} else {
		for _, blk := range blocks {
			if err := c.writeBlock(blk); err != nil {
				return err
			}
		}
	}
	if err := c.writeNodes(commits); err != nil {
		return err
	}
	return c.timedSync()
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
func (c *committer) writeBlock(blk *mblock) error {
	pos := c.geo.blockPos(blk.g)
	var done bool
	var err error
	if lo, hi := blk.wlo, blk.whi; c.caps.WriteMapped != nil && hi > lo && blk.writes >= c.blockPwrites {
		done, err = c.caps.WriteMapped(blk.data[lo:hi], pos+int64(lo))
	}
	if !done {
		_, err = c.p.WriteAt(blk.data, pos)
	}
	if err != nil {
		return fmt.Errorf("write metadata block of group %d: %w", blk.g, err)
	}
	blk.wlo, blk.whi = 0, 0
	blk.writes = min(blk.writes+1, c.blockPwrites)
	return nil
}

// pwritesBeforeMapping is how many times writeBlock writes a block by system call before
// it copies it into the mapping.
const pwritesBeforeMapping = 4

// writeNodes writes the tree nodes of commits in place, a later commit's version of a node
// over an earlier one's, and nodes that lie next to each other (the first node of every
// level, at the start of the data area) in one write.
func (c *committer) writeNodes(commits []*tree.Commit) error {
	type nodeOp struct {
		pos  int64
		data []byte
	}
	ops := make([]nodeOp, 0, 16)
	seen := make(map[int64]int)
	for _, tc := range commits {
		if tc == nil {
			continue
		}
		for _, n := range tc.Nodes {
			pos := c.l.NodePos(n.Level, n.Index)
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
			buf = c.scratch.nodeBuf[:0]
			for _, op := range ops[x:y] {
				buf = append(buf, op.data...)
			}
			c.scratch.nodeBuf = buf
		}
		if err := c.writeTearable(buf, ops[x].pos); err != nil {
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
	if c.caps.WriteMapped != nil {
		if ok, err := c.caps.WriteMapped(b, off); ok {
			return err
		}
	}
	_, err := c.p.WriteAt(b, off)
	return err
}

// readOnce reads what a cache will keep (a metadata block, a tree node): by system call
// where the provider would read through a mapping, whose first touch of a page costs
// more than the read (provider.Capabilities.ReadOnce).
func (c *core) readOnce(b []byte, off int64) error {
	var err error
	if c.caps.ReadOnce != nil {
		_, err = c.caps.ReadOnce(b, off)
	} else {
		_, err = c.p.ReadAt(b, off)
	}
	return err
}

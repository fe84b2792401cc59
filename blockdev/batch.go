package blockdev

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// slab holds the ciphertext of consecutive sectors sealed by one write. It is shared by
// the batch entries that point into it and by readers copying from it; it goes back to
// its pool when the last reference is dropped.
// Its bytes never change while referenced.
type slab struct {
	buf   []byte // class·S
	class int    // log2 of the sector capacity
	refs  atomic.Int32
	// kept: a write's own buffer, sealed in place (Device.WriteKeep), not the pool's;
	// the last release hands it back to its owner instead of the pool.
	kept func()
}

// slabPool recycles slabs by power-of-two class, keeping at most maxFree bytes idle, so a
// steady write load allocates nothing and the idle memory stays bounded.
type slabPool struct {
	mu         sync.Mutex
	sectorSize int
	free       [][]*slab // by class
	freeBytes  int64
	maxFree    int64
	allocs     atomic.Uint64 // slabs made, not reused
}

func newSlabPool(sectorSize, maxSectors int, maxFree int64) *slabPool {
	return &slabPool{
		sectorSize: sectorSize,
		free:       make([][]*slab, bits.Len(uint(maxSectors))+1),
		maxFree:    maxFree,
	}
}

// class is the smallest class of slab that holds n sectors.
func class(n int) int { return bits.Len(uint(n - 1)) }

// bytes is the size of the slab that get(n) returns.
func (p *slabPool) bytes(n int) int64 { return int64(1<<class(n)) * int64(p.sectorSize) }

// get returns a slab for n sectors (at most the pool's maxSectors) with one reference.
func (p *slabPool) get(n int) *slab {
	class := class(n)
	p.mu.Lock()
	if l := p.free[class]; len(l) > 0 {
		s := l[len(l)-1]
		p.free[class] = l[:len(l)-1]
		p.freeBytes -= int64(len(s.buf))
		p.mu.Unlock()
		s.refs.Store(1)
		return s
	}
	p.mu.Unlock()
	p.allocs.Add(1)
	s := &slab{buf: make([]byte, (1<<class)*p.sectorSize), class: class}
	s.refs.Store(1)
	return s
}

func (p *slabPool) release(s *slab) { p.releaseN(s, 1) }

// releaseN drops n references to s at once.
func (p *slabPool) releaseN(s *slab, n int32) {
	switch r := s.refs.Add(-n); {
	case r > 0:
		return
	case r < 0:
		panic("blockdev: slab released too often")
	}
	if s.kept != nil {
		s.kept()
		return
	}
	p.mu.Lock()
	if p.freeBytes+int64(len(s.buf)) <= p.maxFree {
		p.free[s.class] = append(p.free[s.class], s)
		p.freeBytes += int64(len(s.buf))
	}
	p.mu.Unlock()
}

// entry is a sector's newest value in a batch: its ciphertext in a slab and its record,
// or (slab nil) a zero record from a trim or write-zeroes.
type entry struct {
	slab  *slab
	off   int32 // byte offset of the ciphertext in slab.buf
	punch bool  // zero entries: the data may be punched out
	rec   record
}

// data is the entry's ciphertext.
func (e *entry) data(s int) []byte { return e.slab.buf[e.off : int(e.off)+s] }

// zeroEntryCost is what a zero entry counts against the batch bound: its share of the index,
// of the journal buffer and of the sort, so that a trim of a whole disk is committed in
// bounded pieces like any write.
const zeroEntryCost = 128

// batch is a set of sector writes committed together. The pending batch takes new writes;
// the committing batch is read-only until its commit returns.
type batch struct {
	seq     uint64 // commit order; Flush waits for the batch it needs by this number
	entries sectorMap
	bytes   int64 // of sealed data and zero entries (see cost)
	first   int64 // monotonic nanoseconds of the first write, for CommitInterval
}

func (b *batch) empty() bool { return b.entries.len() == 0 }

// cost is what b counts against the batch bound: its data and zero entries, and its
// index's spans, so that scattered one-sector writes or trims (a span each) keep a batch's
// memory within the bound too.
func (b *batch) cost() int64 { return b.bytes + int64(b.entries.spanCount())*spanCost }

// batcher holds an authenticated engine's batches and what bounds them: the pending batch
// that writes go into, the one committing, a spare for reuse, the slabs their data lies
// in and the room writers reserve; and the sequence numbers that say how far commits
// have come, which writers and flushes wait on (cond). The committer (commit.go) moves
// batches along through the methods below, and keeps its own scheduling state under mu
// too: whether a commit is due depends on both.
type batcher struct {
	slabs *slabPool
	wake  *wakeup // the committer's
	// The pending batch's bound, limit, adapts between batchFloor (the least: four times
	// commitBytes and two slabs, within maxBatch) and maxBatch (adaptLimit); a batch of
	// commitBytes is committed at once (Config.CommitBytes).
	maxBatch, batchFloor, commitBytes int64
	fixedLimit                        bool // limit stays at maxBatch (concurrentIO)
	epoch                             time.Time

	mu         sync.Mutex
	cond       sync.Cond // commit finished, batch swapped, or failure
	pending    *batch
	committing *batch
	spare      *batch
	started    uint64 // seq of the newest batch that began committing
	committed  uint64 // seq of the newest batch whose commit completed
	// durable: seq of the newest batch that a Flush may acknowledge. In version 1 that
	// is committed. In version 2 a batch's last round must also be followed by a durable
	// journal slot (the next round's, or an empty one, markCompleted): until then the
	// journal names its sectors with their old records, and putting back their old
	// ciphertext would make recovery take those.
	durable     uint64
	wantDurable uint64 // the newest batch a Flush or FUA waits for
	reserved    int64  // bytes writers are sealing for the pending batch
	limit       int64  // pending plus reserved bytes beyond which writers wait (adaptLimit)
	blocked     int    // writers waiting for room in the pending batch
	urgent      bool   // a Flush or FUA waits for the pending batch
	failed      error
}

// init sets b up for c's device and cfg, with batch 1 pending and nothing committed.
func (b *batcher) init(c *core, cfg Config, wake *wakeup) {
	b.wake = wake
	b.maxBatch = cfg.MaxBatchBytes
	if b.maxBatch <= 0 {
		b.maxBatch = DefaultMaxBatchBytes
	}
	piece := int64(c.pieceSectors * c.s)
	b.maxBatch = max(b.maxBatch, piece)
	b.commitBytes = cfg.CommitBytes
	if b.commitBytes <= 0 {
		b.commitBytes = DefaultCommitBytes
	}
	b.commitBytes = min(b.commitBytes, b.maxBatch)
	// At least two slabs, so that a whole-slab write finds room while a batch is open.
	b.batchFloor = min(b.maxBatch, max(4*b.commitBytes, 2*piece))
	b.limit = b.maxBatch // until a commit shows what syncs cost
	b.fixedLimit = c.concurrentIO()
	// Idle slabs kept for reuse: two batches' worth (a full batch may wait while a full
	// one commits) and two spare pieces, so that a steady write load recycles every slab
	// and makes no garbage. With one batch's worth, a sequential load kept making new slabs
	// (faulted in, zeroed, collected), which cost CPU per byte (docs/benchmarks.md,
	// "Measurements behind design choices").
	b.slabs = newSlabPool(c.s, c.pieceSectors, 2*b.maxBatch/piece*piece+2*piece)
	b.epoch = time.Now()
	b.cond.L = &b.mu
	b.pending = &batch{seq: 1}
}

func (b *batcher) now() int64 { return int64(time.Since(b.epoch)) }

// reserve waits until the pending batch has room for cost more bytes (or is empty: a
// request bigger than MaxBatchBytes still goes through, alone) and reserves them. This
// is the backpressure that bounds memory: writers wait for commits.
func (b *batcher) reserve(cost int64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for {
		if b.failed != nil {
			return b.failed
		}
		used := b.pending.cost() + b.reserved
		if used == 0 || used+cost <= b.limit {
			b.reserved += cost
			return nil
		}
		b.blocked++
		b.wake.poke()
		b.cond.Wait()
		b.blocked--
	}
}

func (b *batcher) unreserve(cost int64) {
	b.mu.Lock()
	b.reserved -= cost
	b.cond.Broadcast()
	b.mu.Unlock()
}

// insert puts n sealed sectors of slab sl, from byte base, into the pending batch, as
// reserved for cost, and returns the batch's sequence number.
func (b *batcher) insert(first uint64, n int, sl *slab, base int, recs []record, cost int64) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	p := b.pending
	sl.refs.Add(int32(n))
	s := b.slabs.sectorSize
	for k := range n {
		b.replaceLocked(p, first+uint64(k), entry{slab: sl, off: int32(base + k*s), rec: recs[k]})
	}
	return b.addedLocked(p, cost)
}

// insertZeroes gives sectors [first, first+n) zero entries in the pending batch, whose
// data may be punched out, as reserved for cost.
func (b *batcher) insertZeroes(first, n uint64, cost int64) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	p := b.pending
	for x := range n {
		b.replaceLocked(p, first+x, entry{punch: true})
	}
	return b.addedLocked(p, cost)
}

// replaceLocked makes e sector i's entry in p.
func (b *batcher) replaceLocked(p *batch, i uint64, e entry) {
	if old, replaced := p.entries.put(i, e); replaced && old.slab != nil {
		b.slabs.release(old.slab)
	}
}

// addedLocked accounts for cost bytes moved from the reservation into batch p and wakes
// the committer when the batch fills, or starts while the committer sleeps untimed.
func (b *batcher) addedLocked(p *batch, cost int64) uint64 {
	b.reserved -= cost
	if p.bytes == 0 {
		p.first = b.now()
		b.wake.pokeIfAsleep()
	}
	p.bytes += cost
	if p.cost() >= b.commitBytes {
		b.wake.poke()
	}
	return p.seq
}

// lookup calls fn(k, e) for each sector first+k, k < n, with its newest entry in the
// batches, the pending one's or else the committing one's (nil: in neither), under mu.
// It returns started as it was then, for a reader's second look (recheck).
func (b *batcher) lookup(first uint64, n int, fn func(k int, e *entry)) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	pe, ce := &b.pending.entries, (*sectorMap)(nil)
	if b.committing != nil {
		ce = &b.committing.entries
	}
	var ps, cs *span
	for k := range n {
		i := first + uint64(k)
		if k == 0 || i&spanMask == 0 {
			ps, cs = pe.spanAt(i), ce.spanAt(i)
		}
		e, ok := ps.at(i)
		if !ok {
			e, _ = cs.at(i)
		}
		fn(k, e)
	}
	return b.started
}

// recheck is the second look of a reader whose lookup returned seen (read.go): true if
// no batch began committing since, or exactly one that is still committing, which it
// passes to fn under mu; false if the reader must look again.
func (b *batcher) recheck(seen uint64, fn func(c *batch)) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.started == seen {
		return true
	}
	c := b.committing
	if b.started != seen+1 || c == nil || c.seq != seen+1 {
		return false
	}
	fn(c)
	return true
}

// newest is the sequence number of the newest batch that holds a completed write: what a
// Flush waits for.
func (b *batcher) newest() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.pending.empty() {
		return b.pending.seq
	}
	return b.started
}

// wantLocked notes that a Flush or FUA waits for batch seq: the pending batch becomes
// urgent if it is that one.
func (b *batcher) wantLocked(seq uint64) {
	if b.pending.seq == seq && !b.pending.empty() {
		b.urgent = true
	}
	if seq > b.durable && seq > b.wantDurable {
		b.wantDurable = seq
	}
}

// dueLocked reports whether the pending batch must be committed now, whatever its
// CommitInterval says: a Flush or FUA waits for it or for a later journal slot
// (markDueLocked), writers wait for room, or it reached CommitBytes.
func (b *batcher) dueLocked() bool {
	return b.urgent || b.blocked > 0 || b.pending.cost() >= b.commitBytes || b.markDueLocked()
}

// markDueLocked reports whether a Flush or FUA waits for a committed batch that no later
// journal slot completes yet. Never in version 1, where durable follows committed.
func (b *batcher) markDueLocked() bool {
	return b.durable < b.wantDurable && b.wantDurable <= b.committed
}

// beginLocked makes the pending batch the committing one, with a new pending batch after
// it, and returns it.
func (b *batcher) beginLocked() *batch {
	c := b.pending
	p := b.spare
	b.spare = nil
	if p == nil {
		p = &batch{}
	}
	p.seq = c.seq + 1
	b.pending = p
	b.committing = c
	b.started = c.seq
	b.urgent = false
	b.cond.Broadcast() // writers waiting for room
	return c
}

// endLocked records that the committing batch c was committed, wroteSlot whether its
// commit wrote a journal slot of a new generation (version 2), and keeps c as the spare.
//
// A batch whose commit wrote no such slot is durable at once if every batch before it
// is: that is every batch in version 1, whose journal has no generation, and in version
// 2 a batch of trims of sectors that held nothing. Otherwise c's first slot completed
// the batches before it (completeLocked), and c waits for the next slot.
func (b *batcher) endLocked(c *batch, wroteSlot bool) {
	b.committing = nil
	if !wroteSlot && b.durable == b.committed {
		b.durable = c.seq
	}
	b.committed = c.seq
	b.cond.Broadcast()
	c.entries.reset(b.slabs)
	c.bytes = 0
	b.spare = c
}

// completeLocked records that a durable journal slot completed every batch committed
// before it.
func (b *batcher) completeLocked() {
	if b.durable < b.committed {
		b.durable = b.committed
		b.cond.Broadcast()
	}
}

// failLocked stops the batches after a failed commit: every later write or flush fails
// with err. The committing batch stays visible, so reads stay consistent.
func (b *batcher) failLocked(err error) {
	b.failed = err
	b.cond.Broadcast()
}

// adaptLimit sets how far the pending batch may grow (limit, between batchFloor and
// maxBatch) from the commit of bytes that just took took, syncTime of it syncing.
// Larger batches only pay for themselves where syncs are slow: a commit writes its data
// at some speed w and waits about syncTime regardless of size, so a batch of 9·syncTime·w
// keeps the syncs to a tenth of the time. Where they are quick (tmpfs, a disk with a
// write cache), batches stay small, and so does the memory they cycle through: sealing
// into a small ring that stays in cache is faster than into a large one (sector's
// BenchmarkSealRunDestination), and so are the device's writes with a small bound
// (docs/benchmarks.md, "Measurements behind design choices").
func (b *batcher) adaptLimit(bytes int64, took, syncTime time.Duration) {
	if b.fixedLimit {
		// Over a network provider every step of a commit is a round trip, the writes'
		// as much as the syncs': all of a commit's time but the transfer is fixed cost.
		b.limit = b.maxBatch
		return
	}
	want := b.maxBatch
	if busy := took - syncTime; busy > 0 {
		want = int64(9 * float64(bytes) * float64(syncTime) / float64(busy))
	}
	b.limit = min(b.maxBatch, max(b.batchFloor, want))
}

package blockdev

import (
	"math/bits"
	"sync"
	"sync/atomic"
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

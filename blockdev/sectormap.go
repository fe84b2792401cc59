package blockdev

import (
	"cmp"
	"math/bits"
	"slices"
	"unsafe"
)

// A batch's entries by sector index. Writes arrive as runs of consecutive sectors (a 1 MiB
// request is 256 of them), reads look up runs, and a commit walks the batch in index
// order; so entries live in spans of spanSectors consecutive sectors, one map lookup per
// span rather than per sector, and the commit sorts span keys, a sixteenth as many as
// sectors, instead of every index. The key list holds each span's pointer too: the
// commit's walk and the reset then touch only the spans, not the map, and the reset
// clears only the entries in use. Between a lone random write and its commit the batch's
// memory leaves the cache, so what the commit touches per write is what it costs.

const (
	spanShift   = 4
	spanSectors = 1 << spanShift
	spanMask    = spanSectors - 1
	// maxFreeSpans bounds the spans a sectorMap keeps for reuse after reset (about
	// 1 MiB: a 16 MiB batch of sequential 4 KiB sectors).
	maxFreeSpans = 1024
)

// spanCost is what a span counts against the batch bound (batch.cost), with its share of
// the map and of the key list.
const spanCost = int64(unsafe.Sizeof(span{})) + 64

type span struct {
	used uint16 // bit j: e[j] holds sector key·spanSectors+j
	e    [spanSectors]entry
}

// at is sector i's entry in sp (which may be nil, the span of i or not).
func (sp *span) at(i uint64) (*entry, bool) {
	if sp == nil || sp.used&(1<<(i&spanMask)) == 0 {
		return nil, false
	}
	return &sp.e[i&spanMask], true
}

// sectorMap is a sparse map from sector index to entry. Its zero value is empty. Lookups
// do not change it, so concurrent readers need only exclude writers.
type sectorMap struct {
	spans map[uint64]*span
	list  []spanRef // the spans, in creation order until sorted
	n     int       // entries
	free  []*span
	// The span put used last: writes come in runs.
	lastKey uint64
	last    *span
}

func (m *sectorMap) len() int { return m.n }

// spanCount is how many spans m holds.
func (m *sectorMap) spanCount() int { return len(m.list) }

// spanRef is a span and its key (its first sector / spanSectors).
type spanRef struct {
	key uint64
	sp  *span
}

// spanAt is the span that would hold sector i, or nil (also when m is nil).
func (m *sectorMap) spanAt(i uint64) *span {
	if m == nil || m.n == 0 {
		return nil
	}
	return m.spans[i>>spanShift]
}

func (m *sectorMap) get(i uint64) (*entry, bool) { return m.spanAt(i).at(i) }

// put makes e sector i's entry. It returns the entry replaced, if any.
func (m *sectorMap) put(i uint64, e entry) (old entry, replaced bool) {
	key := i >> spanShift
	sp := m.last
	if sp == nil || m.lastKey != key {
		sp = m.spans[key]
		if sp == nil {
			if m.spans == nil {
				m.spans = make(map[uint64]*span)
			}
			if k := len(m.free); k > 0 {
				sp = m.free[k-1]
				m.free = m.free[:k-1]
			} else {
				sp = new(span)
			}
			m.spans[key] = sp
			m.list = append(m.list, spanRef{key, sp})
		}
		m.lastKey, m.last = key, sp
	}
	j := i & spanMask
	if sp.used&(1<<j) != 0 {
		old, replaced = sp.e[j], true
	} else {
		sp.used |= 1 << j
		m.n++
	}
	sp.e[j] = e
	return old, replaced
}

// ref is a sector of a batch and its entry, which stays put until the batch is reset.
type ref struct {
	i uint64
	e *entry
}

// appendSorted appends every sector and its entry to dst in increasing index order.
func (m *sectorMap) appendSorted(dst []ref) []ref {
	if !slices.IsSortedFunc(m.list, compareSpans) {
		slices.SortFunc(m.list, compareSpans)
	}
	for _, s := range m.list {
		key, sp := s.key, s.sp
		for u := sp.used; u != 0; u &= u - 1 {
			j := bits.TrailingZeros16(u)
			dst = append(dst, ref{i: key<<spanShift | uint64(j), e: &sp.e[j]})
		}
	}
	return dst
}

func compareSpans(a, b spanRef) int { return cmp.Compare(a.key, b.key) }

// reset empties m, giving each entry's slab reference back to pool (one release per run
// of entries in the same slab).
func (m *sectorMap) reset(pool *slabPool) {
	var held *slab
	var refs int32
	for _, s := range m.list {
		sp := s.sp
		for u := sp.used; u != 0; u &= u - 1 {
			e := &sp.e[bits.TrailingZeros16(u)]
			if sl := e.slab; sl != nil {
				if sl != held {
					if held != nil {
						pool.releaseN(held, refs)
					}
					held, refs = sl, 0
				}
				refs++
			}
			*e = entry{}
		}
		sp.used = 0
		if len(m.free) < maxFreeSpans {
			m.free = append(m.free, sp)
		}
	}
	if held != nil {
		pool.releaseN(held, refs)
	}
	clear(m.spans)
	clear(m.list) // the spans' pointers, for the collector
	m.list = m.list[:0]
	m.n = 0
	m.last = nil
}

package blockdev

// Extent is a run of bytes that share an allocation state (NBD_CMD_BLOCK_STATUS,
// "base:allocation").
type Extent struct {
	Length int64
	// Hole: no data is stored for the run. Zero: it reads as zeroes.
	Hole, Zero bool
}

// extentGroups bounds the metadata groups that one extents call looks at, so that a query
// of a whole large device costs a bounded number of cache loads and bounded memory; the
// client asks again from where the answer ends.
const extentGroups = 64

// Extent states of a sector while extents classifies it.
const (
	extUnknown uint8 = iota // in no batch: its record decides
	extData
	extHole
)

// extents classifies each sector of the range by its newest record: a pending write's,
// else a committing one's, else the one on the provider (through the metadata cache).
// The batches are looked at first: a sector in no batch then has its final record in the
// cache already, since a commit patches records before its batch stops being visible.
func (a *authEngine) extents(off, length int64) ([]Extent, error) {
	s := int64(a.s)
	first, last := uint64(off/s), uint64((off+length-1)/s)
	g0, _ := a.geo.groupOf(first)
	end := min(last+1, (g0+uint64(min(extentGroups, a.cache.capacity())))*a.geo.perGroup)
	state := make([]uint8, end-first)

	a.batches.lookup(first, len(state), func(k int, e *entry) {
		switch {
		case e == nil:
		case e.rec.isZero():
			state[k] = extHole
		default:
			state[k] = extData
		}
	})

	recs := make([]byte, a.geo.perGroup*uint64(len(record{})))
	for k := 0; k < len(state); {
		g, j := a.geo.groupOf(first + uint64(k))
		n := min(len(state)-k, a.geo.groupSectors(g)-j)
		if err := a.cache.records(g, j, recs[:n*len(record{})]); err != nil {
			return nil, err
		}
		for x := range n {
			if state[k+x] != extUnknown {
				continue
			}
			var r record
			copy(r[:], recs[x*len(r):])
			if o, ok := a.overrides[first+uint64(k+x)]; ok {
				r = o
			}
			state[k+x] = extData
			if r.isZero() {
				state[k+x] = extHole
			}
		}
		k += n
	}

	var out []Extent
	pos, stop := off, min(off+length, int64(end)*s)
	for k, st := range state {
		next := min(stop, (int64(first)+int64(k)+1)*s)
		hole := st == extHole
		if n := len(out); n > 0 && out[n-1].Hole == hole {
			out[n-1].Length += next - pos
		} else {
			out = append(out, Extent{Length: next - pos, Hole: hole, Zero: hole})
		}
		pos = next
	}
	return out, nil
}

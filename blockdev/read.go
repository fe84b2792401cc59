package blockdev

import (
	"errors"
	"fmt"
	"sync"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/sector"
)

// Reads in authenticated modes. A sector's newest value is in the pending batch, else in
// the committing batch, else on the provider (its record in the metadata cache, its data
// in the data area).
//
// The race to avoid: a reader finds a sector in no batch, and while it reads record and
// data, a commit that started after its look writes that sector in place, so the reader
// pairs an old record with new data (or the reverse) and fails authentication for a write
// that did nothing wrong. The committing batch stays visible until its in-place writes and
// cache updates have returned, and batches begin committing in sequence, so after its
// disk reads the reader looks again:
//
//   - no batch began committing since its first look: no commit touched its sectors in the
//     meantime (the batch committing then, if any, did not hold them: the reader looked);
//   - exactly one began and is still committing: any of its sectors that the batch holds
//     are taken from the batch instead; the others were not touched;
//   - otherwise (a commit began and finished during the read) it reads again. The third
//     attempt holds commitMu, which keeps the next commit from starting its writes, so a
//     read cannot starve behind a stream of commits.
//
// TestReadDuringCommit exercises this under -race.

// SectorError is a read that failed because of one sector (the first that failed): it
// says which, and where in the device, so that an NBD server can report the offset
// (nbd.OffsetError). Err wraps sector.ErrAuth when the sector failed authentication.
type SectorError struct {
	Sector uint64
	// Offset is the first byte of the request that belongs to the sector: the sector's
	// start, or the request's if it starts inside the sector.
	Offset int64
	Err    error
}

func (e *SectorError) Error() string {
	return fmt.Sprintf("read sector %d (offset %d): %v", e.Sector, e.Offset, e.Err)
}

func (e *SectorError) Unwrap() error { return e.Err }

type srcKind uint8

const (
	srcDisk  srcKind = iota // record from the cache (rec), data read into dst
	srcBatch                // a batch entry: ciphertext in slab (or zero record if slab is nil)
)

type source struct {
	kind srcKind
	slab *slab
	off  int32
	rec  record
}

type readScratch struct {
	src  []source
	recs []byte
	runs []readRun
}

var readScratchPool = sync.Pool{New: func() any { return new(readScratch) }}

// readSectors reads n whole sectors (n ≤ pieceSectors) starting at first into dst
// (n·S bytes, no spare capacity needed).
func (d *Device) readSectors(dst []byte, first uint64, n int) error {
	if !d.geo.auth {
		return d.plainReadSectors(dst, first, n)
	}
	rs := readScratchPool.Get().(*readScratch)
	defer readScratchPool.Put(rs)
	if cap(rs.src) < n {
		rs.src = make([]source, d.pieceSectors)
		rs.recs = make([]byte, d.pieceSectors*layout.RecordSize)
	}
	src := rs.src[:n]
	defer d.dropRefs(src)
	for attempt := 0; ; attempt++ {
		locked := attempt >= 2
		if locked {
			d.commitMu.Lock()
		}
		seen := d.classify(first, src)
		err := d.fetchDisk(dst, first, src, rs.recs[:n*layout.RecordSize], &rs.runs)
		ok := err == nil && d.revalidate(first, src, seen)
		if locked {
			d.commitMu.Unlock()
		}
		if err != nil {
			return err
		}
		if ok {
			break
		}
		d.dropRefs(src)
	}
	// rs.recs is free again (fetchDisk copied the records into src), and chunks use
	// disjoint parts of it.
	return d.workers.run(n, d.chunkSectors, func(lo, hi int) error {
		return d.openRuns(dst, first, src, lo, hi, rs.recs)
	})
}

func (d *Device) dropRefs(src []source) {
	for k := range src {
		if src[k].slab != nil {
			d.slabs.release(src[k].slab)
			src[k].slab = nil
		}
	}
}

func (s *source) fromEntry(e entry) {
	*s = source{kind: srcBatch, slab: e.slab, off: e.off, rec: e.rec}
	if e.slab != nil {
		e.slab.refs.Add(1)
	}
}

// classify looks each sector up in the batches and returns the commit sequence it saw.
func (d *Device) classify(first uint64, src []source) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	pe := d.pending.entries
	var ce map[uint64]entry
	if d.committing != nil {
		ce = d.committing.entries
	}
	for k := range src {
		i := first + uint64(k)
		src[k] = source{kind: srcDisk}
		if len(pe) > 0 {
			if e, ok := pe[i]; ok {
				src[k].fromEntry(e)
				continue
			}
		}
		if len(ce) > 0 {
			if e, ok := ce[i]; ok {
				src[k].fromEntry(e)
			}
		}
	}
	return d.started
}

// revalidate is the second look described above.
func (d *Device) revalidate(first uint64, src []source, seen uint64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.started == seen {
		return true
	}
	c := d.committing
	if d.started != seen+1 || c == nil || c.seq != seen+1 {
		return false
	}
	for k := range src {
		if src[k].kind != srcDisk {
			continue
		}
		if e, ok := c.entries[first+uint64(k)]; ok {
			src[k].fromEntry(e)
		}
	}
	return true
}

// fetchDisk fills in the records of the sectors that are in no batch and reads the data
// of those whose record is not zero, one ReadAt per run of such sectors in a group.
func (d *Device) fetchDisk(dst []byte, first uint64, src []source, recs []byte, scratch *[]readRun) error {
	n := len(src)
	runs := (*scratch)[:0]
	defer func() { *scratch = runs }()
	for k := 0; k < n; {
		if src[k].kind != srcDisk {
			k++
			continue
		}
		g, j := d.geo.groupOf(first + uint64(k))
		end := min(n, k+d.geo.groupSectors(g)-j) // end of this group within the request
		if err := d.cache.records(g, j, recs[k*layout.RecordSize:end*layout.RecordSize]); err != nil {
			return err
		}
		for x := k; x < end; x++ {
			if src[x].kind != srcDisk {
				continue
			}
			copy(src[x].rec[:], recs[x*layout.RecordSize:])
			if d.overrides != nil {
				if r, ok := d.overrides[first+uint64(x)]; ok {
					src[x].rec = r
				}
			}
		}
		// Data of sectors with a record, coalesced into runs of at most ioPiece sectors.
		for x := k; x < end; {
			if src[x].kind != srcDisk || src[x].rec.isZero() {
				x++
				continue
			}
			y := x + 1
			for y < end && y-x < d.ioPiece && src[y].kind == srcDisk && !src[y].rec.isZero() {
				y++
			}
			runs = append(runs, readRun{x, y})
			x = y
		}
		k = end
	}
	// The pieces are read in parallel: the kernel's copy out of the page cache is a good
	// part of a read's cost, and one thread would leave the other cores idle meanwhile.
	read := func(r readRun) error {
		if _, err := d.p.ReadAt(dst[r.lo*d.s:r.hi*d.s], d.geo.dataPos(first+uint64(r.lo))); err != nil {
			return fmt.Errorf("read sectors %d-%d: %w", first+uint64(r.lo), first+uint64(r.hi-1), err)
		}
		return nil
	}
	switch len(runs) {
	case 0:
		return nil
	case 1:
		return read(runs[0])
	}
	return d.workers.run(len(runs), 1, func(lo, hi int) error {
		for _, r := range runs[lo:hi] {
			if err := read(r); err != nil {
				return err
			}
		}
		return nil
	})
}

// readRun is sectors [lo, hi) of a request, stored contiguously on the provider.
type readRun struct{ lo, hi int }

// openRuns turns sectors [lo, hi) of dst into plaintext: one OpenRunMeta per run of
// sectors that have a record, whose records it lines up in recs (at the sectors' own
// positions, RecordSize bytes each).
func (d *Device) openRuns(dst []byte, first uint64, src []source, lo, hi int, recs []byte) error {
	s := d.s
	const rs = layout.RecordSize
	var firstErr error
	for k := lo; k < hi; {
		if src[k].rec.isZero() {
			// Never written, trimmed or zeroed: zeroes, whatever the data area holds.
			clear(dst[k*s : (k+1)*s])
			k++
			continue
		}
		j := k
		for ; j < hi && !src[j].rec.isZero(); j++ {
			if sc := &src[j]; sc.kind == srcBatch {
				copy(dst[j*s:(j+1)*s], sc.slab.buf[sc.off:int(sc.off)+s])
			}
			copy(recs[j*rs:(j+1)*rs], src[j].rec[:])
		}
		err := d.runs.OpenRunMeta(first+uint64(k), dst[k*s:j*s], dst[k*s:j*s], recs[k*rs:j*rs])
		if err != nil {
			var bad *sector.RunAuthError
			if !errors.As(err, &bad) {
				return fmt.Errorf("open sectors %d-%d: %w", first+uint64(k), first+uint64(j-1), err)
			}
			for _, i := range bad.Sectors {
				serr := fmt.Errorf("sector %d: %w", i, sector.ErrAuth)
				d.reportAuth(i, serr)
				if firstErr == nil {
					firstErr = &SectorError{Sector: i, Offset: int64(i) * int64(s), Err: serr}
				}
			}
		}
		k = j
	}
	return firstErr
}

package blockdev

import (
	"errors"
	"fmt"
	"slices"
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
//     attempt holds the committer (hold), which keeps the next commit from starting its
//     writes, so a read cannot starve behind a stream of commits.
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
	src   []source
	recs  []byte
	badMu sync.Mutex // chunks append to bad in parallel
	bad   []uint64   // sectors that failed to open, in no order
}

var readScratchPool = sync.Pool{New: func() any { return new(readScratch) }}

// readSectors reads n whole sectors (n ≤ pieceSectors) starting at first into dst
// (n·S bytes, no spare capacity needed).
func (a *authEngine) readSectors(dst []byte, first uint64, n int) error {
	return a.read(dst, first, n, nil)
}

// readOut is what a re-encryption's sweep learns from a read besides the plaintext.
type readOut struct {
	prev []bool   // by position: the sector opened under the previous key
	bad  []uint64 // sectors that open under no key, in order (not an error then)
	// seal, if set, is called for each chunk [lo, hi) of the read once it is read and
	// opened, by the goroutine that did so, while the chunk is in its core's cache: the
	// sweep seals the chunk's sectors under the current key there. A read that must look
	// again calls it again for the sectors it reads again.
	seal func(lo, hi int)
	// moved are the sectors that the read took from the committing batch after their
	// chunk's seal (see read): they hold plaintext, not sealed.
	moved []int
}

// read is readSectors; with out, it also says which sectors opened under the previous
// key, and lists those that fail in out.bad instead of failing the read.
func (a *authEngine) read(dst []byte, first uint64, n int, out *readOut) error {
	rs := readScratchPool.Get().(*readScratch)
	defer readScratchPool.Put(rs)
	if cap(rs.src) < n {
		rs.src = make([]source, a.pieceSectors)
		rs.recs = make([]byte, a.pieceSectors*layout.RecordSize)
	}
	src, recs := rs.src[:n], rs.recs[:n*layout.RecordSize]
	defer a.dropRefs(src)
	var prev []bool // nil unless out
	if out != nil {
		prev = out.prev[:n]
	}
	var moved []int
	for attempt := 0; ; attempt++ {
		locked := attempt >= 2
		if locked {
			a.commits.hold()
		}
		seen := a.classify(first, src)
		rs.bad = rs.bad[:0]
		clear(prev)
		err := a.fetchRecords(first, src, recs)
		if err == nil {
			// Each chunk reads its sectors from the provider and opens them at once, while
			// they are still in this core's cache; a failure to open is only noted here,
			// since a commit may have rewritten the sector under the read.
			if n <= a.chunkSectors && out == nil { // as in sealInsert: no pool, no closure
				var bad []uint64
				bad, err = a.readOpen(dst, first, src, recs, 0, n, prev)
				rs.noteBad(bad)
			} else {
				run := a.workers.runRead
				if out != nil {
					run = a.workers.run // the sweep's next read is not a client waiting: no spinning
				}
				err = run(n, a.chunkSectors, func(lo, hi int) error {
					bad, err := a.readOpen(dst, first, src, recs, lo, hi, prev)
					rs.noteBad(bad)
					if err == nil && out != nil && out.seal != nil {
						out.seal(lo, hi)
					}
					return err
				})
			}
		}
		ok := false
		if err == nil {
			moved, ok = a.revalidate(first, src, seen, moved[:0])
		}
		if locked {
			a.commits.release()
		}
		if err != nil {
			if errors.Is(err, ErrFreshness) {
				// Every sector of the request that the refused metadata covers fails with
				// it: each is an authentication failure as much as a bad tag.
				a.stats.authFailures.Add(uint64(n))
			}
			return err
		}
		if ok {
			break
		}
		a.dropRefs(src)
	}
	// Sectors that the commit that began during the read holds come from its batch: the
	// bytes read from the provider may pair an old record with new data.
	for _, k := range moved {
		i := first + uint64(k)
		rs.bad = slices.DeleteFunc(rs.bad, func(b uint64) bool { return b == i })
		if prev != nil {
			prev[k] = false
		}
		bad, err := a.openRuns(dst, first, src, recs, k, k+1, prev)
		if err != nil {
			return err
		}
		rs.noteBad(bad)
	}
	slices.Sort(rs.bad)
	var firstErr error
	for _, i := range rs.bad {
		serr := fmt.Errorf("sector %d: %w", i, sector.ErrAuth)
		a.reportAuth(i, serr)
		if firstErr == nil {
			firstErr = &SectorError{Sector: i, Offset: int64(i) * int64(a.s), Err: serr}
		}
	}
	if out != nil {
		out.bad = append(out.bad[:0], rs.bad...)
		out.moved = append(out.moved[:0], moved...)
		return nil
	}
	return firstErr
}

func (rs *readScratch) noteBad(bad []uint64) {
	if len(bad) > 0 {
		rs.badMu.Lock()
		rs.bad = append(rs.bad, bad...)
		rs.badMu.Unlock()
	}
}

func (a *authEngine) dropRefs(src []source) {
	for k := range src {
		if src[k].slab != nil {
			a.batches.slabs.release(src[k].slab)
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
func (a *authEngine) classify(first uint64, src []source) uint64 {
	return a.batches.lookup(first, len(src), func(k int, e *entry) {
		src[k] = source{kind: srcDisk}
		if e != nil {
			src[k].fromEntry(*e)
		}
	})
}

// revalidate is the second look described above. It appends to moved the sectors that it
// switched to the committing batch.
func (a *authEngine) revalidate(first uint64, src []source, seen uint64, moved []int) ([]int, bool) {
	ok := a.batches.recheck(seen, func(c *batch) {
		for k := range src {
			if src[k].kind != srcDisk {
				continue
			}
			if e, ok := c.entries.get(first + uint64(k)); ok {
				src[k].fromEntry(*e)
				moved = append(moved, k)
			}
		}
	})
	return moved, ok
}

// fetchRecords fills in the records of the sectors that are in no batch, and lines them
// up in recs (RecordSize bytes each, at the sectors' positions) for OpenRunMeta; openRuns
// lines up those of batch sectors. Groups without such a sector are not looked up.
func (a *authEngine) fetchRecords(first uint64, src []source, recs []byte) error {
	const rs = layout.RecordSize
	n := len(src)
	for k := 0; k < n; {
		if src[k].kind != srcDisk {
			k++
			continue
		}
		g, j := a.geo.groupOf(first + uint64(k))
		end := min(n, k+a.geo.groupSectors(g)-j) // end of this group within the request
		if err := a.cache.records(g, j, recs[k*rs:end*rs]); err != nil {
			return err
		}
		for x := k; x < end; x++ {
			sc := &src[x]
			if sc.kind != srcDisk {
				continue
			}
			if a.overrides != nil {
				if r, ok := a.overrides[first+uint64(x)]; ok {
					copy(recs[x*rs:(x+1)*rs], r[:])
				}
			}
			copy(sc.rec[:], recs[x*rs:])
		}
		k = end
	}
	return nil
}

// readOpen reads sectors [lo, hi) that are in no batch and have a record from the
// provider (one ReadAt per run of them within a group), then opens [lo, hi) in place. It
// returns the sectors that failed to open; prev (if not nil) is openRuns'.
func (a *authEngine) readOpen(dst []byte, first uint64, src []source, recs []byte, lo, hi int, prev []bool) ([]uint64, error) {
	for x := lo; x < hi; {
		if src[x].kind != srcDisk || src[x].rec.isZero() {
			x++
			continue
		}
		g, j := a.geo.groupOf(first + uint64(x))
		end := min(hi, x+a.geo.groupSectors(g)-j)
		y := x + 1
		for y < end && src[y].kind == srcDisk && !src[y].rec.isZero() {
			y++
		}
		if _, err := a.p.ReadAt(dst[x*a.s:y*a.s], a.geo.dataPos(first+uint64(x))); err != nil {
			return nil, fmt.Errorf("read sectors %d-%d: %w", first+uint64(x), first+uint64(y-1), err)
		}
		x = y
	}
	return a.openRuns(dst, first, src, recs, lo, hi, prev)
}

// openRuns turns sectors [lo, hi) of dst into plaintext: batch sectors are copied from
// their slab, then one OpenRunMeta per run of sectors that have a record (recs lined up by
// fetchRecords). It returns the sectors that fail authentication (their bytes in dst are
// zeroed). During a re-encryption a sector may be sealed under either key (openTwoKeys);
// prev, if not nil, is set for the sectors that opened under the previous one.
func (a *authEngine) openRuns(dst []byte, first uint64, src []source, recs []byte, lo, hi int, prev []bool) ([]uint64, error) {
	s := a.s
	const rs = layout.RecordSize
	var bad []uint64
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
				copy(recs[j*rs:(j+1)*rs], sc.rec[:])
			}
		}
		if a.keys.prev != nil {
			var err error
			if bad, err = a.openTwoKeys(dst, first, src, recs, k, j, prev, bad); err != nil {
				return bad, err
			}
			k = j
			continue
		}
		err := a.keys.cur.meta.OpenRunMeta(first+uint64(k), dst[k*s:j*s], dst[k*s:j*s], recs[k*rs:j*rs])
		if err != nil {
			var ae *sector.RunAuthError
			if !errors.As(err, &ae) {
				return bad, fmt.Errorf("open sectors %d-%d: %w", first+uint64(k), first+uint64(j-1), err)
			}
			bad = append(bad, ae.Sectors...)
		}
		k = j
	}
	return bad, nil
}

// openTwoKeys opens the run [k, j) of sectors that have a record during a re-encryption,
// when each may be sealed under the current key or the previous one: a tag verifies under
// the wrong key with negligible probability, so the key that opens a sector is the one
// that sealed it. Each part of the run tries first the key that most of its sectors have
// (the current one below the sweep's cursor, the previous one from there), then the other
// for those that fail, from their ciphertext again: the first try zeroed it (the batch's
// copy for a batch sector, the provider's otherwise, read within the same attempt, so the
// reader's second look covers it). It appends to bad the sectors that open under neither.
func (a *authEngine) openTwoKeys(dst []byte, first uint64, src []source, recs []byte, k, j int, prev []bool, bad []uint64) ([]uint64, error) {
	s := a.s
	const rs = layout.RecordSize
	cursor := a.sweep.cursor.Load()
	for k < j {
		end, prevFirst := j, first+uint64(k) >= cursor
		if !prevFirst && first+uint64(j) > cursor {
			end = int(cursor - first) // the part below the cursor
		}
		one, other := &a.keys.cur, a.keys.prev
		if prevFirst {
			one, other = other, one
		}
		var failed []uint64
		if err := one.meta.OpenRunMeta(first+uint64(k), dst[k*s:end*s], dst[k*s:end*s], recs[k*rs:end*rs]); err != nil {
			var ae *sector.RunAuthError
			if !errors.As(err, &ae) {
				return bad, fmt.Errorf("open sectors %d-%d: %w", first+uint64(k), first+uint64(end-1), err)
			}
			failed = ae.Sectors
		}
		if prev != nil && prevFirst {
			for x := k; x < end; x++ {
				prev[x] = true
			}
		}
		for _, i := range failed {
			x := int(i - first)
			buf := dst[x*s : (x+1)*s]
			if sc := &src[x]; sc.kind == srcBatch {
				copy(buf, sc.slab.buf[sc.off:int(sc.off)+s])
			} else if _, err := a.p.ReadAt(buf, a.geo.dataPos(i)); err != nil {
				return bad, fmt.Errorf("read sector %d: %w", i, err)
			}
			if prev != nil {
				prev[x] = !prevFirst
			}
			if err := other.codec.Open(i, buf, recs[x*rs:(x+1)*rs]); err != nil {
				if !errors.Is(err, sector.ErrAuth) {
					return bad, fmt.Errorf("open sector %d: %w", i, err)
				}
				clear(buf)
				if prev != nil {
					prev[x] = false
				}
				bad = append(bad, i)
			}
		}
		k = end
	}
	return bad, nil
}

package blockdev

import (
	"errors"
	"fmt"

	"github.com/elidisk/eli/sector"
)

// recover is recovery for format version 1: it replays the journal (docs/format.md,
// "Journal"): for each entry, the new record wins if the sector's data opens with it (or
// it is zero), the old one otherwise. It reads one sector per entry, so its cost follows
// the last commit's size, never the volume's. Writable devices write the chosen records,
// sync, and leave an empty journal; read-only ones keep them in memory (a.overrides) and
// write nothing. A minimum generation was refused by newFreshness.
func (noFreshness) recover(a *authEngine, _ uint64) error {
	entries, err := a.jrnl.read(a.p, a.l.Sectors)
	switch {
	case errors.Is(err, errNoJournal):
		a.rec.Journal = "zero"
		a.log.Debug("journal: nothing to recover", "detail", err)
		return nil
	case errors.Is(err, errJournalTorn):
		// Its sync never completed, so none of its in-place writes started.
		a.rec.Journal = "torn"
		a.log.Info("journal: the last commit was interrupted before it reached the data area; nothing to recover", "detail", err)
		return nil
	case err != nil:
		return err
	case len(entries) == 0:
		a.rec.Journal = "empty"
		return nil
	}
	a.rec = Recovery{Journal: "replayed", Sectors: len(entries), InMemory: a.ro}
	if a.ro {
		a.overrides = make(map[uint64]record)
	}
	buf := make([]byte, a.s)
	var blocks []*mblock
	defer func() {
		for _, b := range blocks {
			a.cache.unpin(b)
		}
	}()
	for _, e := range entries {
		choice, err := a.choose(e, buf)
		if err != nil {
			return err
		}
		g, j := a.geo.groupOf(e.index)
		if len(blocks) == 0 || blocks[len(blocks)-1].g != g {
			b, err := a.cache.get(g)
			if err != nil {
				return err
			}
			blocks = append(blocks, b)
		}
		b := blocks[len(blocks)-1]
		if a.cache.record(b, j) == choice {
			continue
		}
		if a.ro {
			a.overrides[e.index] = choice
		} else {
			a.cache.patch(b, j, &choice)
		}
	}
	r := a.rec
	a.log.Info("journal: recovered the last commit", "sectors", r.Sectors,
		"rolled_forward", r.RolledForward, "rolled_back", r.RolledBack, "in_memory_only", r.InMemory)
	if a.ro {
		return nil
	}
	if err := a.commits.writeBlocks(blocks, nil); err != nil {
		return err
	}
	// The records are durable: the journal has done its job.
	return a.commits.writeJournal(nil)
}

// applyOverrides puts the records that a read-only recovery kept in memory into a block
// loaded from the provider: in version 2 the block's digest must cover them.
func (a *authEngine) applyOverrides(g uint64, buf []byte) {
	first := g * a.geo.perGroup
	for j := range a.geo.groupSectors(g) {
		if r, ok := a.overrides[first+uint64(j)]; ok {
			copy(buf[j*len(r):], r[:])
		}
	}
}

// choose is recovery's decision for one journal entry, counted in a.rec: the new record if
// the sector's data on the provider opens with it (a zero new record always counts as
// opening), the old one otherwise. buf is scratch of one sector, cleared after use.
func (a *authEngine) choose(e journalEntry, buf []byte) (record, error) {
	r, err := a.decide(e, buf)
	switch {
	case err != nil:
	case r == e.new:
		a.rec.RolledForward++
	default:
		a.rec.RolledBack++
	}
	return r, err
}

// decide is choose without the count. During a re-encryption the new record may be
// under either key (a round committed before the re-encryption began, or after), so the
// data must open with it under one of them.
func (a *authEngine) decide(e journalEntry, buf []byte) (record, error) {
	if e.new.isZero() {
		return e.new, nil
	}
	defer clear(buf)
	sets := []*keySet{&a.keys.cur}
	if a.keys.prev != nil {
		sets = append(sets, a.keys.prev)
	}
	for _, k := range sets {
		// Read for each try: a failed open leaves buf unspecified.
		if _, err := a.p.ReadAt(buf, a.geo.dataPos(e.index)); err != nil {
			return record{}, fmt.Errorf("read sector %d: %w", e.index, err)
		}
		err := k.codec.Open(e.index, buf, e.new[:])
		switch {
		case err == nil:
			return e.new, nil
		case !errors.Is(err, sector.ErrAuth):
			return record{}, fmt.Errorf("open sector %d: %w", e.index, err)
		}
	}
	return e.old, nil
}

package blockdev

import (
	"crypto/rand"
	"fmt"
	"sync"
)

// authEngine is the engine of authenticated modes.
//
// Every write seals its sectors at once, with a fresh nonce each, into a slab owned by
// the pending batch: a map from sector to (ciphertext, record), kept in spans of 16
// sectors (sectormap.go), where a rewrite replaces the older entry (write.go). Reads see
// the pending batch, then the committing one, then the provider; read.go says why they
// never pair a record with data of another version. Writes smaller than a sector are
// read-modify-write under the sector's stripe lock, which every write takes to insert, so
// no update is lost.
//
// The engine wires its parts, each of which owns its state: the batcher (batch.go: the
// batches and the bound on their memory; while a commit runs, the next batch may grow to
// MaxBatchBytes, beyond which writers wait), the committer (commit.go: batches commit in
// order, one at a time, each in rounds of journal, sync, data and records in place,
// sync), the metadata cache (metacache.go: metadata blocks within CacheBytes; a commit
// pins the blocks of one round at a time, so rounds are also bounded by half the cache),
// the journal (journal.go) and the format version's freshness (fresh.go).
type authEngine struct {
	*core
	cache   *metaCache
	jrnl    *journal
	batches batcher
	commits committer
	fresh   freshness
	sweep   sweepState // of a re-encryption (reencrypt.go)

	rec       Recovery
	overrides map[uint64]record // read-only recovery in memory; immutable after Open
	recPool   sync.Pool         // *[]record
}

// openAuthenticated runs recovery from the journal and starts the committer (unless the
// device is read-only).
func openAuthenticated(c *core, cfg Config) (*authEngine, error) {
	a := &authEngine{core: c}
	a.recPool.New = func() any {
		r := make([]record, a.pieceSectors)
		return &r
	}
	if err := a.open(cfg); err != nil {
		a.keys.wipeJournals()
		return nil, fmt.Errorf("open device: %w", err)
	}
	return a, nil
}

func (a *authEngine) open(cfg Config) error {
	if err := a.keys.cur.setJournalKey(cfg.JournalKey); err != nil {
		return err
	}
	if r := cfg.Reencrypt; r != nil {
		prev, err := prevKeySet(a.l, a.keys.cur.codec, *r)
		if err != nil {
			return err
		}
		if err := a.startReencrypt(prev, *r, false); err != nil {
			return err
		}
	}
	rnd := cfg.rand
	if rnd == nil {
		rnd = rand.Reader
	}
	a.jrnl = newJournal(&a.keys, a.l, rnd)
	var err error
	if a.fresh, err = newFreshness(a.core, a.jrnl, cfg); err != nil {
		return err
	}
	cacheBytes := cfg.CacheBytes
	if cacheBytes <= 0 {
		cacheBytes = DefaultCacheBytes
	}
	a.cache = newMetaCache(a.l.MetaBlockSize(), cacheBytes, func(g uint64, buf []byte) error {
		if err := a.readOnce(buf, a.geo.blockPos(g)); err != nil {
			return fmt.Errorf("read: %w", err)
		}
		if a.overrides != nil {
			a.applyOverrides(g, buf)
		}
		return nil
	}, a.fresh.verifier())
	a.batches.init(a.core, cfg, &a.commits.wake)
	a.commits.init(a.core, &a.batches, a.cache, a.jrnl, a.fresh, cfg)
	if err := a.fresh.recover(a, cfg.MinGeneration); err != nil {
		return fmt.Errorf("recovery: %w", err)
	}
	if !a.ro {
		a.commits.start()
	}
	return nil
}

func (a *authEngine) recovery() Recovery { return a.rec }

func (a *authEngine) cacheStats(st *Stats) {
	st.CacheBlocks, st.CacheLoads, st.CacheEvictions = a.cache.stats()
}

func (a *authEngine) writeAt(p []byte, off int64, flags Flags) error {
	return a.write(p, off, flags, nil)
}

// writeKeep is writeAt sealing whole sectors in place, in p, which the batch keeps
// (Device.WriteKeep).
func (a *authEngine) writeKeep(p []byte, off int64, flags Flags, done func()) error {
	kept := &slab{buf: p, kept: done}
	kept.refs.Store(1)
	err := a.write(p, off, flags, kept)
	a.batches.slabs.release(kept) // the entries hold their own references
	return err
}

// write writes p at off; with kept (a slab over p), whole sectors are sealed in place.
func (a *authEngine) write(p []byte, off int64, flags Flags, kept *slab) error {
	var last uint64
	err := a.forSectors(p, off, func(run []byte, first uint64, n int) error {
		var seq uint64
		var err error
		if kept != nil {
			seq, err = a.writeKept(kept, int(int64(first)*int64(a.s)-off), first, n)
		} else {
			seq, err = a.writeWhole(run, first, n)
		}
		last = max(last, seq)
		return err
	}, func(i uint64, o int, part []byte) error {
		seq, err := a.writePartial(i, o, part)
		last = max(last, seq)
		return err
	})
	if err != nil {
		return err
	}
	if flags&FUA != 0 {
		return a.commits.waitDurable(last)
	}
	return nil
}

// writeZeroes gives whole sectors a punched zero record, and zeroes partial ones at the
// edges by read-modify-write. With NoHole, whole sectors are written as sealed zeroes
// instead: a zero record is a hole (Extents reports it so), and where the provider never
// held the sector's data it has no room for it either, which NoHole asks for. Neither
// that nor a read-modify-write is faster than a write, so FastZero fails for them.
func (a *authEngine) writeZeroes(off, length int64, flags Flags) error {
	s := int64(a.s)
	if flags&FastZero != 0 && (flags&NoHole != 0 || off%s != 0 || length%s != 0) {
		return ErrSlowZero
	}
	var last uint64
	if o := off % s; o != 0 && length > 0 {
		n := min(length, s-o)
		seq, err := a.writePartial(uint64(off/s), int(o), zeroes(int(n)))
		if err != nil {
			return err
		}
		last, off, length = max(last, seq), off+n, length-n
	}
	if whole := length / s; whole > 0 && flags&NoHole != 0 {
		k := max(s, int64(len(zeroBuf))/s*s)
		for end := off + whole*s; off < end; {
			n := min(k, end-off)
			seq, err := a.writeWhole(zeroes(int(n)), uint64(off/s), int(n/s))
			if err != nil {
				return err
			}
			last, off, length = max(last, seq), off+n, length-n
		}
	} else if whole > 0 {
		seq, err := a.zeroWhole(uint64(off/s), uint64(whole))
		if err != nil {
			return err
		}
		last, off, length = max(last, seq), off+whole*s, length-whole*s
	}
	if length > 0 {
		seq, err := a.writePartial(uint64(off/s), 0, zeroes(int(length)))
		if err != nil {
			return err
		}
		last = max(last, seq)
	}
	if flags&FUA != 0 {
		return a.commits.waitDurable(last)
	}
	return nil
}

func (a *authEngine) trim(first, n uint64, flags Flags) error {
	seq, err := a.zeroWhole(first, n)
	if err != nil {
		return err
	}
	if flags&FUA != 0 {
		return a.commits.waitDurable(seq)
	}
	return nil
}

// flush waits for the newest batch that holds a completed write, so it covers writes
// from every connection.
func (a *authEngine) flush() error {
	if err := a.commits.waitDurable(a.batches.newest()); err != nil {
		return err
	}
	a.fresh.report()
	return nil
}

// close stops the committer once it has committed what is pending, leaves an empty
// journal, and wipes the journal key.
func (a *authEngine) close(suspended bool) error {
	defer a.keys.wipeJournals()
	if a.ro {
		return nil
	}
	if err := a.commits.stop(); err != nil || suspended {
		return err // suspended: suspend left the empty journal
	}
	// Everything is committed: an empty journal makes the next Open skip recovery.
	if err := a.commits.markCompleted(); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	a.fresh.report()
	return nil
}

// suspend commits what is pending and leaves an empty journal, as close does, with the
// committer left running (idle: the device holds every request until it resumes).
func (a *authEngine) suspend() error {
	if a.ro {
		return nil
	}
	if err := a.flush(); err != nil {
		return err
	}
	if err := a.commits.markCompletedNow(); err != nil {
		return err
	}
	a.fresh.report()
	return nil
}

// withKeys holds the committer, which seals journals without the gate.
func (a *authEngine) withKeys(f func()) {
	a.commits.hold()
	defer a.commits.release()
	f()
}

// loadMeta loads the metadata blocks of the range, at most as many as the cache holds.
func (a *authEngine) loadMeta(off, length int64) error {
	s := int64(a.s)
	g0, _ := a.geo.groupOf(uint64(off / s))
	g1, _ := a.geo.groupOf(uint64((off + length - 1) / s))
	for g := g0; g <= g1 && g-g0 < uint64(a.cache.capacity()); g++ {
		b, err := a.cache.get(g)
		if err != nil {
			return err
		}
		a.cache.unpin(b)
	}
	return nil
}

package blockdev

import (
	"crypto/rand"
	"fmt"
	"sync"
	"time"

	"github.com/elidisk/eli/blockdev/internal/tree"
	"github.com/elidisk/eli/sector"
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
// Batches commit in order, one at a time, each in rounds of journal, sync, data and
// records in place, sync (commit.go): in the committer goroutine, or in a Flush that
// finds no commit running. While a commit runs, the next batch may
// grow to MaxBatchBytes, beyond which writers wait, so memory stays bounded. The
// metadata cache (metacache.go) holds metadata blocks within CacheBytes; a commit pins
// the blocks of one round at a time, so rounds are also bounded by half the cache.
type authEngine struct {
	*core
	runs sector.MetaRunner

	recPool     sync.Pool // *[]record
	cache       *metaCache
	jrnl        *journal
	slabs       *slabPool
	overrides   map[uint64]record // read-only recovery in memory; immutable after Open
	maxBatch    int64
	batchFloor  int64 // the least limit: 4·commitBytes and two slabs, within maxBatch
	commitBytes int64 // a batch this large is committed at once (see Config.CommitBytes)
	interval    time.Duration
	epoch       time.Time
	roundMax    int // distinct groups per commit round (metadata blocks pinned at once)
	rec         Recovery
	// blockPwrites: a metadata block's writes by system call before writeBlock copies it
	// into a mapping (pwritesBeforeMapping; the crash tests lower it).
	blockPwrites int

	// Format version 2 (fresh.go): the hash tree (nil in version 1), set by recovery.
	tree        *tree.Tree
	onFlushed   func(gen uint64, root [32]byte)
	reportMu    sync.Mutex // serializes onFlushed calls
	reported    uint64     // the newest generation reported
	reportedAny bool
	mismatchMu  sync.Mutex
	mismatched  map[uint64]bool // groups whose mismatch was logged

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
	stopping    bool
	running     bool // a goroutine is committing (runLocked)
	deferred    bool // the committer found work while running: poke it when done
	asleep      bool // the committer waits for a poke, no timer armed
	failed      error
	fresh       Freshness // version 2: generation and root of the newest durable journal slot
	kick        chan struct{}
	done        chan struct{}
	commitMu    sync.Mutex // held for a whole commit
	// For tests: how often the committer went to wait and woke, and how many jobs
	// flushes ran.
	waits, wakes, flushJobs uint64

	// State of the goroutine that is running a commit.
	syncTime time.Duration // spent in syncs by the commit under way
	dataOps  []dataOp
	sortBuf  []ref // a batch's sectors in index order
	jentries []journalEntry
	written  []ref // the sectors of jentries
	blocks   []*mblock
	leaves   []tree.Leaf
	nodeBuf  []byte // adjacent tree nodes, written as one
}

// openAuthenticated runs recovery from the journal and starts the committer (unless the
// device is read-only).
func openAuthenticated(c *core, runs sector.MetaRunner, cfg Config) (*authEngine, error) {
	a := &authEngine{core: c, runs: runs}
	a.recPool.New = func() any {
		r := make([]record, a.pieceSectors)
		return &r
	}
	if err := a.open(cfg); err != nil {
		return nil, err
	}
	return a, nil
}

func (a *authEngine) open(cfg Config) error {
	if len(cfg.JournalKey) != JournalKeySize {
		return fmt.Errorf("open device: journal key is %d bytes, want %d", len(cfg.JournalKey), JournalKeySize)
	}
	rnd := cfg.rand
	if rnd == nil {
		rnd = rand.Reader
	}
	var err error
	if a.jrnl, err = newJournal(cfg.JournalKey, a.l, rnd); err != nil {
		return fmt.Errorf("open device: %w", err)
	}
	cacheBytes := cfg.CacheBytes
	if cacheBytes <= 0 {
		cacheBytes = DefaultCacheBytes
	}
	m := a.l.MetaBlockSize()
	v2 := a.l.Tree()
	a.cache = newMetaCache(m, cacheBytes, func(g uint64, buf []byte) error {
		if err := a.readOnce(buf, a.geo.blockPos(g)); err != nil {
			return fmt.Errorf("read: %w", err)
		}
		if v2 && a.overrides != nil {
			a.applyOverrides(g, buf)
		}
		return nil
	})
	if v2 {
		a.cache.hashed = true
		a.cache.verify = a.verifyBlock
		a.onFlushed = cfg.OnFlushed
	} else if cfg.MinGeneration > 0 {
		a.jrnl.wipe()
		return fmt.Errorf("open device: a minimum generation (%d) was given, but a format version 1 volume has no generation", cfg.MinGeneration)
	}
	// A round pins its metadata blocks, so it may use half of the cache; the other half
	// keeps serving readers.
	a.roundMax = max(1, a.cache.capacity()/2)
	a.maxBatch = cfg.MaxBatchBytes
	if a.maxBatch <= 0 {
		a.maxBatch = DefaultMaxBatchBytes
	}
	a.maxBatch = max(a.maxBatch, int64(a.pieceSectors*a.s))
	a.blockPwrites = pwritesBeforeMapping
	a.commitBytes = cfg.CommitBytes
	if a.commitBytes <= 0 {
		a.commitBytes = DefaultCommitBytes
	}
	a.commitBytes = min(a.commitBytes, a.maxBatch)
	// At least two slabs, so that a whole-slab write finds room while a batch is open.
	a.batchFloor = min(a.maxBatch, max(4*a.commitBytes, int64(2*a.pieceSectors*a.s)))
	a.limit = a.maxBatch // until a commit shows what syncs cost
	a.interval = cfg.CommitInterval
	if a.interval <= 0 {
		a.interval = DefaultCommitInterval
	}
	// Idle slabs kept for reuse: two batches' worth (a full batch may wait while a full
	// one commits) and two spare pieces, so that a steady write load recycles every slab
	// and makes no garbage. With one batch's worth, a sequential load kept making new slabs
	// (faulted in, zeroed, collected), which cost CPU per byte (docs/benchmarks.md,
	// "Measurements behind design choices").
	piece := int64(a.pieceSectors * a.s)
	a.slabs = newSlabPool(a.s, a.pieceSectors, 2*a.maxBatch/int64(a.pieceSectors*a.s)*piece+2*piece)
	a.epoch = time.Now()
	a.cond.L = &a.mu
	if err := a.recover(cfg.MinGeneration); err != nil {
		a.jrnl.wipe()
		return fmt.Errorf("open device: recovery: %w", err)
	}
	a.pending = &batch{seq: 1}
	a.durable, a.committed, a.started = a.pending.seq-1, a.pending.seq-1, a.pending.seq-1
	if !a.ro {
		a.kick = make(chan struct{}, 1)
		a.done = make(chan struct{})
		go a.committer()
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
	a.slabs.release(kept) // the entries hold their own references
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
		return a.waitDurable(last)
	}
	return nil
}

// writeZeroes gives whole sectors a zero record (punched unless NoHole) and zeroes
// partial ones at the edges by read-modify-write.
func (a *authEngine) writeZeroes(off, length int64, flags Flags) error {
	var last uint64
	s := int64(a.s)
	if o := off % s; o != 0 && length > 0 {
		n := min(length, s-o)
		seq, err := a.writePartial(uint64(off/s), int(o), zeroes(int(n)))
		if err != nil {
			return err
		}
		last, off, length = max(last, seq), off+n, length-n
	}
	if whole := length / s; whole > 0 {
		seq, err := a.zeroWhole(uint64(off/s), uint64(whole), flags&NoHole == 0)
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
		return a.waitDurable(last)
	}
	return nil
}

func (a *authEngine) trim(first, n uint64, flags Flags) error {
	seq, err := a.zeroWhole(first, n, true)
	if err != nil {
		return err
	}
	if flags&FUA != 0 {
		return a.waitDurable(seq)
	}
	return nil
}

// flush waits for the newest batch that holds a completed write, so it covers writes
// from every connection.
func (a *authEngine) flush() error {
	a.mu.Lock()
	target := a.started
	if !a.pending.empty() {
		target = a.pending.seq
	}
	a.mu.Unlock()
	if err := a.waitDurable(target); err != nil {
		return err
	}
	a.reportFresh()
	return nil
}

// close stops the committer once it has committed what is pending, leaves an empty
// journal, and wipes the journal key.
func (a *authEngine) close() error {
	defer a.jrnl.wipe()
	if a.ro {
		return nil
	}
	a.mu.Lock()
	a.stopping = true
	a.mu.Unlock()
	a.poke()
	<-a.done
	a.mu.Lock()
	err := a.failed
	a.mu.Unlock()
	if err != nil {
		return err
	}
	// Everything is committed: an empty journal makes the next Open skip recovery.
	if a.tree != nil {
		if err := a.writeJournal2(nil); err != nil {
			return fmt.Errorf("close: %w", err)
		}
		a.setFresh()
		a.reportFresh()
		return nil
	}
	if err := a.writeJournal(nil); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	return nil
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

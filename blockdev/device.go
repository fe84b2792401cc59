package blockdev

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// Flags qualify a write-type request: FUA, NoHole, FastZero, as NBD's command flags do.
// Their bits are blockdev's own; package volume maps NBD's to them by name.
type Flags uint16

const (
	// FUA: the write is durable when the call returns.
	FUA Flags = 1 << iota
	// NoHole: WriteZeroes must leave the range allocated, not a hole.
	NoHole
	// FastZero: WriteZeroes fails with an error wrapping ENOTSUP unless zeroing is cheap.
	FastZero
)

// Errors of the Device. Each wraps the errno an NBD server reports for it.
var (
	ErrReadOnly   = fmt.Errorf("device is read-only: %w", syscall.EPERM)
	ErrClosed     = fmt.Errorf("device is closed: %w", syscall.ESHUTDOWN)
	ErrOutOfRange = fmt.Errorf("request outside the device: %w", syscall.EINVAL)
	ErrPastEnd    = fmt.Errorf("write past the end of the device: %w", syscall.ENOSPC)
	ErrSlowZero   = fmt.Errorf("zeroing is not faster than writing zeroes in this mode: %w", syscall.ENOTSUP)
)

// Defaults for the zero values of Config.
const (
	DefaultCacheBytes     = 64 << 20
	DefaultCommitInterval = 100 * time.Millisecond
	DefaultMaxBatchBytes  = 16 << 20
	DefaultCommitBytes    = 1 << 20
)

// Config is what Open needs besides the provider.
type Config struct {
	Layout Layout
	// Codec seals and opens sectors; its sector size and metadata size must match Layout.
	// The Device never wipes it: the codec's keys are the caller's.
	Codec sector.Codec
	// JournalKey (JournalKeySize bytes) seals the journal of authenticated modes. Open
	// copies it; the copy is wiped by Close.
	JournalKey []byte
	// ReadOnly refuses writes. A journal left by a crash is then applied in memory only
	// (the provider is not written), so reads see the recovered volume.
	ReadOnly bool
	// CacheBytes bounds the metadata cache (DefaultCacheBytes when 0).
	CacheBytes int64
	// CommitInterval is how long the first write of a batch may wait for company before
	// the batch is committed (DefaultCommitInterval when 0).
	CommitInterval time.Duration
	// MaxBatchBytes bounds the sealed data waiting for a commit; writers wait beyond it
	// (DefaultMaxBatchBytes when 0, at least one slab of 1 MiB). Memory for batches,
	// including idle slabs kept for reuse, is at most about four times this. Batches
	// grow that large only where syncs are slow: where they are quick the bound is four
	// times CommitBytes, and at least two 1 MiB slabs (see adaptLimit).
	MaxBatchBytes int64
	// CommitBytes: a pending batch this large is committed at once
	// (DefaultCommitBytes when 0, at most MaxBatchBytes). While a commit runs, the next
	// batch keeps growing up to MaxBatchBytes, so batches stay small (and in cache) when
	// commits are quick, and grow to spread the syncs when they are slow.
	CommitBytes int64
	// Workers is the size of the sealing pool (GOMAXPROCS when 0; negative: none).
	Workers int
	// Logger receives one line per notable event (recovery, a sector failing
	// authentication, a failed commit). Nil logs nowhere.
	Logger *slog.Logger

	// MinGeneration (format version 2) refuses a provider whose newest journal generation
	// is older (ErrRolledBack, naming both): the generation a witness recorded at an earlier
	// flush. A newer provider is accepted (a crash between its flush and the witness's
	// update). Zero checks nothing; nonzero refuses a version 1 volume, which has none.
	MinGeneration uint64
	// OnFlushed (format version 2) is called after each completed Flush, and by Close,
	// with the generation and root of the hash tree that are durable then, for a witness
	// to record. It runs on the flushing request's goroutine, one call at a time, and only
	// when the generation is newer than the last one reported (concurrent flushes may
	// share a report); the Flush returns after it. It must not call the Device.
	OnFlushed func(gen uint64, root [32]byte)

	// Reencrypt, when the volume's header says a re-encryption is under way, gives the
	// previous key and where the sweep stands (reencrypt.go). Codec and JournalKey are
	// then the current keys.
	Reencrypt *Reencrypt

	// rand replaces crypto/rand for journal nonces: tests that write golden volumes.
	rand io.Reader
}

// Device is an attached volume: the plaintext sectors of a provider. Its methods are safe
// for concurrent use; the NBD server calls them from many requests and connections.
//
// A Device checks each request and hands it to the engine of its mode: authEngine
// (auth.go) or plainEngine (plain.go).
type Device struct {
	core
	eng engine

	// gate: every request holds it shared; Close takes it exclusively, so Close waits for
	// requests in flight and later requests see closed.
	gate   sync.RWMutex
	closed bool
	// activity counts client requests, which a re-encryption's sweep yields to.
	activity atomic.Uint64

	// Suspend and resume (suspend.go). susMu orders Suspend, Resume and Close; susp is
	// set (under the gate held exclusively) while the device is suspended, and hold is
	// where requests wait meanwhile. sweeper is the re-encryption's Sweeper, if one was
	// made, which Suspend pauses.
	susMu   sync.Mutex
	susp    *suspension
	hold    hold
	sweeper atomic.Pointer[Sweeper]
}

// engine is what one family of modes does with whole sectors and with requests that the
// Device has checked: in bounds, the device open, writes allowed. Its methods are called
// with the gate held shared, except close, which holds it exclusively. What one family
// of modes needs beyond a sector's ciphertext (records, batches, a journal, and any later
// per-sector state) belongs to its engine alone.
type engine interface {
	// readSectors reads n whole sectors (n ≤ pieceSectors) from first into dst.
	readSectors(dst []byte, first uint64, n int) error
	writeAt(p []byte, off int64, flags Flags) error
	writeZeroes(off, length int64, flags Flags) error
	// trim drops whole sectors [first, first+n), n > 0.
	trim(first, n uint64, flags Flags) error
	// flush is called on writable devices only.
	flush() error
	// loadMeta loads the metadata of a non-empty range.
	loadMeta(off, length int64) error
	// extents describes a non-empty range (see Device.Extents).
	extents(off, length int64) ([]Extent, error)
	// close makes everything durable and releases what the engine holds (the workers
	// are the Device's). On a suspended device (suspended true) everything is durable
	// already and there is no key: it only releases.
	close(suspended bool) error
	// suspend makes every write durable before the keys are wiped: what close does,
	// without stopping anything.
	suspend() error
	// withKeys runs f, which changes the keyring, while nothing of the engine's own
	// (a committer sealing a journal) uses it; the gate is held exclusively.
	withKeys(f func())
	recovery() Recovery
	cacheStats(st *Stats)
}

// core is what the Device and its engine share: the provider, the layout's numbers, the
// keys, scratch buffers, the worker pool, the stripe locks and the counters.
type core struct {
	p provider.Provider
	// caps are p's, asked once at Open. Of its operations, Punch trims and zeroes,
	// WriteMapped writes the journal, metadata blocks and tree nodes where the provider
	// can without a system call (writeTearable), and ReadOnce reads metadata blocks and
	// tree nodes, which the caches keep, by system call where ReadAt would go through a
	// mapping; each is nil where the provider has no such operation.
	caps provider.Capabilities
	l    Layout
	geo  geometry // l's numbers, for the per-sector paths
	keys keyring
	ro   bool
	log  *slog.Logger
	s    int   // sector size
	size int64 // bytes exposed

	pieceSectors int // sectors per slab and per step of a large request
	chunkSectors int // sectors per parallel chunk
	ioPiece      int // sectors per write of a commit (in parallel unless caps.SerialWrites)
	workers      *workers
	locks        stripes
	bufs         sync.Pool // *[]byte of pieceSectors·S, for scratch
	authLog      authLog

	stats struct {
		commits, rounds, sectors, syncs, authFailures atomic.Uint64
	}
}

// Open attaches the volume on p. For authenticated modes it first runs recovery from the
// journal (see docs/format.md), which costs time in proportion to the last commit, and
// logs what it did. Open does not lock the provider: that is the caller's job.
func Open(p provider.Provider, cfg Config) (*Device, error) {
	l, c := cfg.Layout, cfg.Codec
	if c == nil {
		return nil, errors.New("open device: no codec")
	}
	if err := l.Validate(p.Size()); err != nil {
		return nil, fmt.Errorf("open device: %w", err)
	}
	if c.SectorSize() != l.SectorSize || c.MetaSize() != l.MetaSize() {
		return nil, fmt.Errorf("open device: codec %s has %d-byte sectors and %d-byte records, layout %d and %d",
			c.Mode(), c.SectorSize(), c.MetaSize(), l.SectorSize, l.MetaSize())
	}
	if l.Size()/int64(l.SectorSize) != int64(l.Sectors) {
		return nil, fmt.Errorf("open device: %d sectors overflow the size", l.Sectors)
	}
	// Every request goes to the codec as runs of sectors; sector's codecs all take them.
	cur, err := newKeySet(c)
	if err != nil {
		return nil, fmt.Errorf("open device: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Device{core: core{
		p: p, caps: provider.CapabilitiesOf(p), l: l, geo: newGeometry(l), ro: cfg.ReadOnly, log: log,
		keys: keyring{cur: cur},
		s:    l.SectorSize, size: l.Size(),
	}}
	d.pieceSectors = max(1, (1<<20)/d.s)
	d.chunkSectors = max(1, (64<<10)/d.s)
	d.ioPiece = max(1, (256<<10)/d.s)
	d.bufs.New = func() any {
		b := make([]byte, d.pieceSectors*d.s)
		return &b
	}
	n := cfg.Workers
	if n == 0 {
		n = runtime.GOMAXPROCS(0)
	}
	d.workers = newWorkers(max(0, n))
	if !l.Authenticated() {
		e := newPlainEngine(&d.core)
		if r := cfg.Reencrypt; r != nil {
			prev, err := prevKeySet(l, c, *r)
			if err == nil {
				err = e.startReencrypt(prev, *r, false)
			}
			if err != nil {
				d.workers.stop()
				return nil, fmt.Errorf("open device: re-encryption: %w", err)
			}
		}
		d.eng = e
		return d, nil
	}
	a, err := openAuthenticated(&d.core, cfg)
	if err != nil {
		d.workers.stop()
		return nil, err
	}
	d.eng = a
	return d, nil
}

// Size is the number of bytes exposed.
func (d *Device) Size() int64 { return d.size }

// SectorSize is the unit below which writes are read-modify-write.
func (d *Device) SectorSize() int { return d.s }

// Layout is the layout the device was opened with.
func (d *Device) Layout() Layout { return d.l }

// Recovery reports what Open found in the journal.
type Recovery struct {
	// Journal is one of "none" (length-preserving mode), "zero" (never written),
	// "empty" (clean close), "torn" (the last commit never reached the data area) or
	// "replayed".
	Journal string
	// Sectors is the number of entries replayed; RolledForward of them got their new
	// record, RolledBack their old one.
	Sectors, RolledForward, RolledBack int
	// InMemory: the device is read-only, so the outcome was applied in memory only.
	InMemory bool
}

// Freshness reports the generation and root of the newest durable journal slot of a
// format version 2 volume (ok false for other volumes): where recovery from the provider
// would start now. For a read-only device that recovered a journal in memory, the root
// is the recovered one, which the provider does not hold.
func (d *Device) Freshness() (f Freshness, ok bool) {
	if a, isAuth := d.eng.(*authEngine); isAuth {
		return a.fresh.current()
	}
	return Freshness{}, false
}

// Recovery reports what Open's recovery did.
func (d *Device) Recovery() Recovery { return d.eng.recovery() }

// Stats are counters for monitoring and tests.
type Stats struct {
	Commits          uint64 // batches committed
	Rounds           uint64 // journal rounds (a batch larger than the journal takes several)
	SectorsCommitted uint64
	Syncs            uint64
	AuthFailures     uint64 // sector reads that failed authentication
	CacheBlocks      int    // metadata blocks held now
	CacheLoads       uint64
	CacheEvictions   uint64
}

func (d *Device) Stats() Stats {
	st := Stats{
		Commits:          d.stats.commits.Load(),
		Rounds:           d.stats.rounds.Load(),
		SectorsCommitted: d.stats.sectors.Load(),
		Syncs:            d.stats.syncs.Load(),
		AuthFailures:     d.stats.authFailures.Load(),
	}
	d.eng.cacheStats(&st)
	return st
}

// enter starts a client request; leave ends it.
func (d *Device) enter(write bool) error {
	d.activity.Add(1)
	return d.enterGate(write)
}

// enterGate is enter for the device's own work (a re-encryption's sweep). While the
// device is suspended it waits for Resume (suspend.go).
func (d *Device) enterGate(write bool) error {
	for {
		w := d.hold.wait()
		d.gate.RLock()
		w.entered()
		switch {
		case d.closed:
			d.gate.RUnlock()
			return ErrClosed
		case d.susp != nil:
			// Suspended between the look at the hold and the gate: wait in the queue.
			d.gate.RUnlock()
			continue
		case write && d.ro:
			d.gate.RUnlock()
			return ErrReadOnly
		}
		return nil
	}
}

// lockGate takes the gate exclusively for a change of the device's keys or state,
// waiting, as requests do, while the device is suspended.
func (d *Device) lockGate() error {
	for {
		w := d.hold.wait()
		d.gate.Lock()
		w.entered()
		switch {
		case d.closed:
			d.gate.Unlock()
			return ErrClosed
		case d.susp != nil:
			d.gate.Unlock()
			continue
		}
		return nil
	}
}

func (d *Device) leave() { d.gate.RUnlock() }

// check bounds a request. Lengths and offsets come from a client: both are checked
// before any arithmetic uses them.
func (d *Device) check(off, n int64, write bool) error {
	if off < 0 || n < 0 {
		return fmt.Errorf("offset %d length %d: %w", off, n, ErrOutOfRange)
	}
	if off > d.size || n > d.size-off {
		if write {
			return fmt.Errorf("offset %d length %d on a %d-byte device: %w", off, n, d.size, ErrPastEnd)
		}
		return fmt.Errorf("offset %d length %d on a %d-byte device: %w", off, n, d.size, ErrOutOfRange)
	}
	return nil
}

func (c *core) getBuf() *[]byte  { return c.bufs.Get().(*[]byte) }
func (c *core) putBuf(b *[]byte) { c.bufs.Put(b) }

// ReadAt fills p with the plaintext at off. A sector that fails authentication makes the
// request fail with an error wrapping sector.ErrAuth (and so EIO); p's contents are then
// unspecified and must not be returned.
func (d *Device) ReadAt(p []byte, off int64) error {
	if err := d.enter(false); err != nil {
		return err
	}
	defer d.leave()
	if err := d.check(off, int64(len(p)), false); err != nil {
		return err
	}
	err := d.forSectors(p, off, d.eng.readSectors, func(i uint64, o int, part []byte) error {
		bp := d.getBuf()
		defer d.putBuf(bp)
		buf := (*bp)[:d.s]
		if err := d.eng.readSectors(buf, i, 1); err != nil {
			return err
		}
		copy(part, buf[o:])
		return nil
	})
	var se *SectorError
	if errors.As(err, &se) && se.Offset < off {
		se.Offset = off
	}
	return err
}

// Extents describes how [off, off+length) is stored, for NBD_CMD_BLOCK_STATUS
// ("base:allocation"): runs contiguous from off, at least one, covering at most length
// (a long range may be answered in part: ask again from where the answer ends). In
// authenticated modes a sector whose record is zero (never written, trimmed or zeroed)
// is a hole that reads as zeroes, and a sector with a write not yet committed counts as
// that write leaves it. Length-preserving modes report data throughout. Extents reads
// records, never sector data.
func (d *Device) Extents(off, length int64) ([]Extent, error) {
	if err := d.enter(false); err != nil {
		return nil, err
	}
	defer d.leave()
	if err := d.check(off, length, false); err != nil {
		return nil, err
	}
	if length == 0 {
		return nil, fmt.Errorf("extents of an empty range at offset %d: %w", off, ErrOutOfRange)
	}
	return d.eng.extents(off, length)
}

// Cache loads the metadata of [off, off+length) into the metadata cache, as far as the
// cache holds it, so later reads of the range find their records in memory (NBD_CMD_CACHE;
// nbd.Cacher). Length-preserving modes have nothing to load.
func (d *Device) Cache(off, length int64) error {
	if err := d.enter(false); err != nil {
		return err
	}
	defer d.leave()
	if err := d.check(off, length, false); err != nil {
		return err
	}
	if length == 0 {
		return nil
	}
	return d.eng.loadMeta(off, length)
}

// forSectors splits [off, off+len(p)) into whole-sector pieces of at most pieceSectors
// (passed to whole) and partial sectors at the edges (passed to partial with the sector,
// the offset in it and the slice of p).
func (c *core) forSectors(p []byte, off int64, whole func(p []byte, first uint64, n int) error,
	partial func(i uint64, o int, part []byte) error) error {
	s := int64(c.s)
	for len(p) > 0 {
		i, o := uint64(off/s), int(off%s)
		if o != 0 || len(p) < c.s {
			n := min(len(p), c.s-o)
			if err := partial(i, o, p[:n]); err != nil {
				return err
			}
			p, off = p[n:], off+int64(n)
			continue
		}
		n := min(len(p)/c.s, c.pieceSectors)
		if err := whole(p[:n*c.s], i, n); err != nil {
			return err
		}
		p, off = p[n*c.s:], off+int64(n)*s
	}
	return nil
}

// WriteAt writes p at off. With FUA the write is durable when WriteAt returns.
func (d *Device) WriteAt(p []byte, off int64, flags Flags) error {
	return d.write(p, off, flags, nil)
}

// WriteKeep is WriteAt for a caller that gives p up until done is called (nbd.Keeper):
// in authenticated modes the whole sectors of p are sealed where they lie, and the
// pending batch keeps p until they are committed, instead of a copy in a slab of its own.
// This saves writing every byte into memory that is not in the cache. done is called
// once p is no longer used, before WriteKeep returns or after; if the device fails and
// keeps its batches for reads, never.
func (d *Device) WriteKeep(p []byte, off int64, flags Flags, done func()) error {
	return d.write(p, off, flags, done)
}

// write is WriteAt, or with done WriteKeep. done is called on every path that does not
// hand p to the batch.
func (d *Device) write(p []byte, off int64, flags Flags, done func()) error {
	a, keeps := d.eng.(*authEngine)
	if done != nil && !keeps {
		defer done() // this engine only reads p
		done = nil
	}
	err := d.enter(true)
	if err == nil {
		defer d.leave()
		err = d.check(off, int64(len(p)), true)
	}
	switch {
	case err != nil && done != nil:
		done()
	case err != nil:
	case done != nil:
		err = a.writeKeep(p, off, flags, done)
	default:
		err = d.eng.writeAt(p, off, flags)
	}
	return err
}

// WriteZeroes makes [off, off+length) read as zeroes. In authenticated modes whole sectors
// get a zero record with their data punched out, which is fast, or with NoHole are written
// as sealed zeroes, which is not; partial sectors at the edges are zeroed by
// read-modify-write. Length-preserving modes write encrypted zeroes. Where zeroing is no
// faster than writing, FastZero fails with an error wrapping ENOTSUP (ErrSlowZero).
func (d *Device) WriteZeroes(off, length int64, flags Flags) error {
	if err := d.enter(true); err != nil {
		return err
	}
	defer d.leave()
	if err := d.check(off, length, true); err != nil {
		return err
	}
	return d.eng.writeZeroes(off, length, flags)
}

// Trim drops whole sectors in [off, off+length): in authenticated modes they read as
// zeroes afterwards; in length-preserving modes their data is punched out where the
// provider can (they then read as the decryption of zeroes, which NBD allows after a
// trim). Partial sectors at the edges are left alone.
func (d *Device) Trim(off, length int64, flags Flags) error {
	if err := d.enter(true); err != nil {
		return err
	}
	defer d.leave()
	if err := d.check(off, length, true); err != nil {
		return err
	}
	s := int64(d.s)
	first, end := (off+s-1)/s, (off+length)/s
	if end <= first {
		return nil
	}
	return d.eng.trim(uint64(first), uint64(end-first), flags)
}

// Flush makes every write that completed before it was called durable, whichever
// connection it came from.
func (d *Device) Flush() error {
	if err := d.enter(false); err != nil {
		return err
	}
	defer d.leave()
	if d.ro {
		return nil
	}
	return d.eng.flush()
}

// Close commits what is pending, leaves an empty journal and syncs. It waits for requests
// in flight; later requests fail with ErrClosed. It does not close the provider or wipe
// the codec (both are the caller's), but wipes its copy of the journal key. A suspended
// device made everything durable when it was suspended: Close then fails the held
// requests with ErrClosed (they were never acknowledged) and needs no key.
func (d *Device) Close() error {
	d.susMu.Lock()
	defer d.susMu.Unlock()
	d.gate.Lock()
	if d.closed {
		d.gate.Unlock()
		return ErrClosed
	}
	d.closed = true
	err := d.eng.close(d.susp != nil)
	d.workers.stop()
	d.gate.Unlock()
	d.hold.releaseAll() // the held see closed
	return err
}

func (c *core) sync() error {
	c.stats.syncs.Add(1)
	if err := c.p.Sync(); err != nil {
		return fmt.Errorf("sync provider: %w", err)
	}
	return nil
}

var zeroBuf [64 << 10]byte

// zeroes returns n zero bytes (n ≤ MaxSectorSize) that nobody may write to.
func zeroes(n int) []byte { return zeroBuf[:n] }

// authLog logs a sector that fails authentication once per index, remembering a bounded
// number of indexes so a scan of a damaged volume cannot fill memory or the log.
type authLog struct {
	mu      sync.Mutex
	seen    map[uint64]struct{}
	dropped bool
}

const authLogMax = 4096

func (c *core) reportAuth(index uint64, err error) {
	c.stats.authFailures.Add(1)
	a := &c.authLog
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seen == nil {
		a.seen = make(map[uint64]struct{})
	}
	if _, ok := a.seen[index]; ok {
		return
	}
	if len(a.seen) >= authLogMax {
		if !a.dropped {
			a.dropped = true
			c.log.Error("more sectors fail authentication; not logging each any more", "logged", authLogMax)
		}
		return
	}
	a.seen[index] = struct{}{}
	c.log.Error("sector failed authentication: tampered, corrupted, or torn by a crash on a provider whose atomic write unit is smaller than the sector",
		"sector", index, "err", err)
}

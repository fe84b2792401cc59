package volume

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/nbd"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/reencrypt"
	"github.com/elidisk/eli/sector"
)

// Options say how Open opens a volume.
type Options struct {
	ReadOnly   bool
	CacheBytes int64 // metadata cache (blockdev.DefaultCacheBytes when 0)
	Logger     *slog.Logger
	// Onetime, when set, formats the provider as a header-less volume of this mode and
	// sector size instead of reading its header: whatever it held is lost.
	Onetime *Onetime
	// WriteThrough commits every write before acknowledging it (as if each came with
	// FUA), so that a server killed at any instant has lost no write it acknowledged.
	// The kernel's NBD driver needs it to survive a server crash: when a new server
	// re-plugs the device, the kernel re-sends the requests left unanswered, an
	// interrupted FLUSH among them, but not the writes the dead server had acknowledged
	// and held in its batch; without write-through that FLUSH would succeed over lost
	// data. Length-preserving modes write before they acknowledge anyway, so it changes
	// nothing for them.
	WriteThrough bool
	// Witness is the file that records a format version 2 volume's freshness outside
	// the provider (see witness.go): Open refuses a provider older than it, and the
	// volume keeps it up to date. Empty: no witness. Version 1 volumes have none.
	Witness string
	// AcceptRollback opens a provider older than its witness knowingly (after restoring
	// an image on purpose) and resets the witness to it.
	AcceptRollback bool
}

// Onetime is the geometry of a header-less volume (eli onetime).
type Onetime struct {
	Mode       sector.Mode
	SectorSize int
}

// Volume is an unlocked, open volume: the plaintext sectors of a provider. It is what the
// NBD server serves (it implements nbd.Backend, nbd.Cacher and nbd.BlockStatuser), and
// it counts what it serves for Status.
type Volume struct {
	dev *blockdev.Device
	p   provider.Provider // its header is read again at Resume, and written by a re-encryption
	// codecs are those the device was given, the current one last: Close and Suspend
	// wipe them (nil while suspended: the device wiped them).
	codecs []sector.Codec
	prev   *reencrypt.Previous // the previous keys of a re-encryption under way at Open or Resume, or nil
	mode   atomic.Uint32       // a sector.Mode: a re-encryption may change it
	ro     bool
	fua    blockdev.Flags // FUA under write-through in the batching (authenticated) modes
	wit    *witness       // nil without one
	fmtv   int            // format version
	log    *slog.Logger
	// onetime: the key is a random one that no header holds, so it cannot be given
	// back after a suspend, nor changed by a re-encryption.
	onetime bool
	// keyMu orders Suspend, Resume, Close and a re-encryption's start and end, which
	// change codecs and prev; it is taken before reMu.
	keyMu sync.Mutex

	ops    counters
	faults faults

	fenced    func() error            // a remote provider's Fenced (Fencer), or nil
	health    func() nbdclient.Health // a remote provider's Health, or nil
	deadliner Deadliner               // a remote provider, or nil

	warnings  []string     // what Open found wrong that does not stop the volume
	lastFlush atomic.Int64 // Unix nanoseconds of the last flush that succeeded

	// A re-encryption (reencrypt.go). prevMode and epoch are those of one under way at
	// Open, for the status of a read-only volume, which does not sweep it.
	reMu     sync.Mutex
	re       *reencryption
	closing  bool
	prevMode sector.Mode
	epoch    uint64
	// sweep paces the sweep (blockdev's defaults: steps that rest as long as they took
	// after overlapping client requests); onStep, if set, hears of every step (tests).
	sweep  blockdev.SweeperConfig
	onStep func(blockdev.ReencryptStatus)
}

// Deadliner is implemented by providers whose I/O can be bounded (remote.Store): after
// SetDeadline(t), every request ends by t whatever the storage does. Shutdown uses it.
type Deadliner interface {
	SetDeadline(t time.Time)
}

// healthReporter is implemented by providers that can say how their storage is doing
// (remote.Store).
type healthReporter interface {
	Health() nbdclient.Health
}

// Fencer is implemented by providers that can lose the right to write: a remote one
// taken over by another host (remote.Store). Once Fenced reports an error, the volume
// fails at once and refuses every write, instead of acknowledging writes into a batch
// whose commit cannot succeed.
type Fencer interface {
	Fenced() error
}

// remoteMaxBatchBytes bounds the sealed data waiting for a commit over a network
// provider (blockdev.Config.MaxBatchBytes; the default is 16 MiB for local ones).
const remoteMaxBatchBytes = 64 << 20

// Open builds the codec and the device of an unlocked provider: it verifies the header
// against mk (or, for Onetime, formats p), and runs the journal's recovery. It does not
// keep mk: the codec and the device hold the keys they derive, and Close wipes them.
func Open(p provider.Provider, mk *keys.MasterKey, opts Options) (*Volume, error) {
	var l layout.Layout
	var mode sector.Mode
	var prev *reencrypt.Previous // a re-encryption under way: its previous keys
	var hdr *keys.Header
	if o := opts.Onetime; o != nil {
		var err error
		if l, err = formatOnetime(p, o); err != nil {
			return nil, err
		}
		mode = o.Mode
	} else {
		var err error
		if hdr, prev, err = unlockHeader(p, mk); err != nil {
			return nil, err
		}
		mode, l = hdr.Mode, hdr.Layout
	}
	dk := mk.DataKey(mode)
	defer dk.Wipe()
	codec, err := sector.New(sector.Params{Mode: mode, SectorSize: l.SectorSize, Key: dk.Bytes(), VolumeID: mk.VolumeID()})
	if err != nil {
		prev.Wipe()
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var wit *witness
	if opts.Witness != "" && l.Version >= 2 {
		if wit, err = openWitness(opts.Witness, mk.VolumeID(), log); err != nil {
			codec.Wipe()
			prev.Wipe()
			return nil, err
		}
	}
	jk := mk.JournalKey()
	defer jk.Wipe()
	cfg := blockdev.Config{
		Layout:     l,
		Codec:      codec,
		JournalKey: jk.Bytes(),
		ReadOnly:   opts.ReadOnly,
		CacheBytes: opts.CacheBytes,
		Logger:     opts.Logger,
	}
	if wit != nil {
		cfg.MinGeneration = wit.minGeneration(opts.AcceptRollback)
		cfg.OnFlushed = wit.record
	}
	if prev != nil {
		// The header says a re-encryption is under way: sectors not moved yet open
		// under the previous key (eli reencrypt finishes it).
		cfg.Reencrypt = prev.Reencrypt
	}
	if provider.CapabilitiesOf(p).Shared {
		// A network provider: each commit costs several round trips whatever its size,
		// so larger batches carry more data per round trip (docs/benchmarks.md, "Remote
		// providers").
		cfg.MaxBatchBytes = remoteMaxBatchBytes
	}
	dev, err := blockdev.Open(p, cfg)
	if err != nil {
		codec.Wipe()
		prev.Wipe()
		if wit != nil {
			wit.close()
		}
		if errors.Is(err, blockdev.ErrRolledBack) {
			err = &RollbackError{Witness: opts.Witness, WitnessGeneration: cfg.MinGeneration, Err: err}
		}
		return nil, err
	}
	v := &Volume{dev: dev, p: p, codecs: []sector.Codec{codec}, prev: prev, ro: opts.ReadOnly, faults: newFaults(), wit: wit, log: log,
		fmtv: int(max(l.Version, layout.Version1)), onetime: opts.Onetime != nil}
	v.setMode(mode)
	if hdr != nil {
		if r := hdr.Reencryption(); r.Active {
			v.prevMode, v.epoch = r.PrevMode, r.Epoch
			if !opts.ReadOnly {
				// The server resumes it once it serves (Server.Start).
				on, err := reencrypt.ResumeOnline(p, dev, mk)
				if err != nil {
					v.Close()
					return nil, fmt.Errorf("resume the re-encryption under way: %w", err)
				}
				v.re = &reencryption{on: on, started: time.Now()}
			}
		}
	}
	if opts.WriteThrough && mode.Authenticated() {
		v.fua = blockdev.FUA
	}
	v.watchProvider(p)
	if f, ok := dev.Freshness(); ok && wit != nil {
		warnings, err := wit.attach(f, opts.AcceptRollback)
		if err != nil {
			v.Close()
			return nil, err
		}
		v.warnings = append(v.warnings, warnings...)
	}
	return v, nil
}

// formatOnetime prepares p for a onetime volume (Options.Onetime): a fresh layout, with
// no header, since the key is never kept.
func formatOnetime(p provider.Provider, o *Onetime) (layout.Layout, error) {
	l, err := layout.Plan(p.Size(), o.SectorSize, o.Mode, 0)
	if err != nil {
		return layout.Layout{}, err
	}
	if err := blockdev.Format(p, l); err != nil {
		return layout.Layout{}, fmt.Errorf("prepare onetime volume: %w", err)
	}
	return l, nil
}

// unlockHeader reads p's header and verifies it against mk: the header, and the
// previous keys of a re-encryption under way (nil when there is none).
func unlockHeader(p provider.Provider, mk *keys.MasterKey) (*keys.Header, *reencrypt.Previous, error) {
	h, err := keys.Read(p)
	if err != nil {
		return nil, nil, err
	}
	if err := h.Verify(mk); err != nil {
		return nil, nil, err
	}
	if err := h.Layout.Validate(p.Size()); err != nil {
		return nil, nil, err
	}
	prev, err := reencrypt.PreviousKeys(h, mk)
	if err != nil {
		return nil, nil, err
	}
	return h, prev, nil
}

// watchProvider keeps what a remote provider can say of itself: whether another host
// took it over, how its storage is doing, and a way to bound its I/O at shutdown.
func (v *Volume) watchProvider(p provider.Provider) {
	if f, ok := p.(Fencer); ok {
		v.fenced = f.Fenced
	}
	if h, ok := p.(healthReporter); ok {
		v.health = h.Health
	}
	if d, ok := p.(Deadliner); ok {
		v.deadliner = d
	}
}

// witnessProblem is what a witness that cannot be written means.
func witnessProblem(path string, err error) string {
	return fmt.Sprintf("the witness %s cannot be written (%v): the volume works, but a rollback of the provider to an older image "+
		"would go unnoticed while this lasts; make its directory writable (or give another witness file)", path, err)
}

// Warnings are what Open found wrong that does not stop the volume.
func (v *Volume) Warnings() []string { return v.warnings }

// WitnessProblem says why the witness does not hold the volume's latest flushed state
// (it could not be written), or "" if it does or the volume has none.
func (v *Volume) WitnessProblem() string {
	if v.wit == nil {
		return ""
	}
	if err := v.wit.failure(); err != nil {
		return witnessProblem(v.wit.path, err)
	}
	return ""
}

// Close commits what is pending, leaves an empty journal, syncs, and wipes the keys. Its
// error is the volume's final status: nil means every write it acknowledged is on the
// provider. It does not close the provider. A witness it could not write at the end is
// not its error (the data is safe): WitnessProblem says so.
func (v *Volume) Close() error {
	v.stopReencrypt() // before keyMu: the sweep's end takes it
	v.keyMu.Lock()
	defer v.keyMu.Unlock()
	err := v.dev.Close()
	v.wipeKeys()
	if v.wit != nil {
		v.wit.close()
	}
	return err
}

// LastFlush is when the last flush the volume acknowledged completed (zero if none).
func (v *Volume) LastFlush() time.Time {
	if n := v.lastFlush.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Freshness is the generation and root of a format version 2 volume's hash tree at its
// last completed flush; ok is false for version 1.
func (v *Volume) Freshness() (blockdev.Freshness, bool) { return v.dev.Freshness() }

// Mode is the volume's cipher mode.
func (v *Volume) Mode() sector.Mode { return sector.Mode(v.mode.Load()) }

func (v *Volume) setMode(m sector.Mode) { v.mode.Store(uint32(m)) }

// Format is the volume's on-disk format version (1, or 2 with the hash tree).
func (v *Volume) Format() int { return v.fmtv }

// SectorSize is the unit below which writes are read-modify-write.
func (v *Volume) SectorSize() int { return v.dev.SectorSize() }

// Recovery reports what opening the volume found in its journal.
func (v *Volume) Recovery() blockdev.Recovery { return v.dev.Recovery() }

// Changed is kicked when the volume fails, for a watcher of its Status to look at once.
func (v *Volume) Changed() <-chan struct{} { return v.faults.changed }

// Err is the provider failure that stopped the volume, or nil.
func (v *Volume) Err() error { return v.faults.err() }

// The nbd.Backend side. Flags and errors cross the seam here, and only here: nbd and
// blockdev each define their own, and nothing but this file knows that they correspond.

var (
	_ nbd.Backend       = (*Volume)(nil)
	_ nbd.Cacher        = (*Volume)(nil)
	_ nbd.BlockStatuser = (*Volume)(nil)
)

// flagMap pairs each nbd flag with the blockdev flag that means the same.
var flagMap = []struct {
	nbd nbd.Flags
	dev blockdev.Flags
}{
	{nbd.FUA, blockdev.FUA},
	{nbd.NoHole, blockdev.NoHole},
	{nbd.FastZero, blockdev.FastZero},
}

// devFlags translates flags bit by named bit; a flag blockdev does not know is dropped
// rather than passed on as some other meaning.
func devFlags(f nbd.Flags) blockdev.Flags {
	var d blockdev.Flags
	for _, m := range flagMap {
		if f&m.nbd != 0 {
			d |= m.dev
		}
	}
	return d
}

// nbdErr gives a device error the shape nbd understands: a read that failed in one
// sector becomes an *nbd.OffsetError, so the client gets NBD_REPLY_TYPE_ERROR_OFFSET
// naming where. The errno the error wraps is kept, so the NBD error value is unchanged.
func nbdErr(err error) error {
	var se *blockdev.SectorError
	if errors.As(err, &se) {
		return &nbd.OffsetError{Offset: se.Offset, Err: err}
	}
	return err
}

// clientErr reports whether err is the request's own fault (out of range, read-only,
// an unsupported fast zero), the device being closed, or something the provider does
// not support (punching a hole for a trim), rather than a failure of the provider.
func clientErr(err error) bool {
	for _, e := range []error{blockdev.ErrReadOnly, blockdev.ErrOutOfRange, blockdev.ErrPastEnd, blockdev.ErrSlowZero,
		blockdev.ErrClosed, syscall.ENOTSUP, syscall.EOPNOTSUPP} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// note records a request's error for Status; a write-side failure of the provider marks
// the volume failed (in the authenticated modes the device accepts no more writes after
// one).
func (v *Volume) note(err error, write bool) error {
	if err == nil {
		return nil
	}
	if write && !clientErr(err) {
		v.faults.fail(err)
	} else {
		v.faults.last(err)
	}
	return nbdErr(err)
}

func (v *Volume) Size() int64 { return v.dev.Size() }

// checkFence fails the volume once its provider is fenced, and says so for a write.
func (v *Volume) checkFence() error {
	if v.fenced == nil {
		return nil
	}
	if err := v.fenced(); err != nil {
		v.faults.fail(err)
		return err
	}
	return nil
}

func (v *Volume) ReadAt(p []byte, off int64) error {
	v.ops.reads.Add(1)
	err := v.dev.ReadAt(p, off)
	if err == nil {
		v.ops.bytesRead.Add(uint64(len(p)))
	}
	return v.note(err, false)
}

func (v *Volume) WriteAt(p []byte, off int64, f nbd.Flags) error {
	return v.write(p, off, f, nil)
}

var _ nbd.Keeper = (*Volume)(nil)

// WriteKeep is WriteAt for the NBD server's own payload buffers (nbd.Keeper): the device
// seals them in place and keeps them until their batch is committed.
func (v *Volume) WriteKeep(p []byte, off int64, f nbd.Flags, done func()) error {
	return v.write(p, off, f, done)
}

// write is WriteAt, or with done WriteKeep.
func (v *Volume) write(p []byte, off int64, f nbd.Flags, done func()) error {
	v.ops.writes.Add(1)
	if err := v.checkFence(); err != nil {
		if done != nil {
			done()
		}
		return err
	}
	var err error
	if done != nil {
		err = v.dev.WriteKeep(p, off, devFlags(f)|v.fua, done)
	} else {
		err = v.dev.WriteAt(p, off, devFlags(f)|v.fua)
	}
	if err == nil {
		v.ops.bytesWritten.Add(uint64(len(p)))
	}
	return v.note(err, true)
}

func (v *Volume) WriteZeroes(off, n int64, f nbd.Flags) error {
	v.ops.zeroes.Add(1)
	if err := v.checkFence(); err != nil {
		return err
	}
	err := v.dev.WriteZeroes(off, n, devFlags(f)|v.fua)
	if errors.Is(err, blockdev.ErrSlowZero) {
		return err // the answer a FastZero request asks for, not a failure
	}
	return v.note(err, true)
}

func (v *Volume) Trim(off, n int64, f nbd.Flags) error {
	v.ops.trims.Add(1)
	if err := v.checkFence(); err != nil {
		return err
	}
	return v.note(v.dev.Trim(off, n, devFlags(f)|v.fua), true)
}

func (v *Volume) Flush() error {
	v.ops.flushes.Add(1)
	if err := v.checkFence(); err != nil {
		return err
	}
	err := v.dev.Flush()
	if err == nil {
		v.lastFlush.Store(time.Now().UnixNano())
	}
	return v.note(err, true)
}

// BlockStatus answers NBD_CMD_BLOCK_STATUS (base:allocation) from the device's records:
// in the authenticated modes, never-written and trimmed sectors are holes that read as
// zeroes, so that clients (nbdcopy, qemu-img convert and map, mirror jobs) skip them.
func (v *Volume) BlockStatus(off, n int64) ([]nbd.Extent, error) {
	ext, err := v.dev.Extents(off, n)
	if err != nil {
		return nil, v.note(err, false)
	}
	out := make([]nbd.Extent, len(ext))
	for i, e := range ext {
		out[i] = nbd.Extent{Length: e.Length, Hole: e.Hole, Zero: e.Zero}
	}
	return out, nil
}

func (v *Volume) Cache(off, n int64) error {
	v.ops.caches.Add(1)
	return v.note(v.dev.Cache(off, n), false)
}

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
	"github.com/elidisk/eli/provider"
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
}

// Onetime is the geometry of a header-less volume (eli onetime).
type Onetime struct {
	Mode       sector.Mode
	SectorSize int
}

// Volume is an unlocked, open volume: the plaintext sectors of a provider. It is what the
// NBD server serves (it implements nbd.Backend and nbd.Cacher), and it counts what it
// serves for Status.
type Volume struct {
	dev   *blockdev.Device
	codec sector.Codec
	mode  sector.Mode
	ro    bool

	reads, writes, zeroes, trims, flushes, caches atomic.Uint64
	bytesRead, bytesWritten                       atomic.Uint64

	mu       sync.Mutex
	failed   error // the first provider failure of a write or flush; sticky
	lastErr  error
	lastTime time.Time
	changed  chan struct{} // kicked when failed is first set

	fenced func() error // a remote provider's Fenced (Fencer), or nil
}

// Fencer is implemented by providers that can lose the right to write: a remote one
// taken over by another host (remote.Store). Once Fenced reports an error, the volume
// fails at once and refuses every write, instead of acknowledging writes into a batch
// whose commit cannot succeed.
type Fencer interface {
	Fenced() error
}

// RemoteMaxBatchBytes bounds the sealed data waiting for a commit over a network
// provider (blockdev.Config.MaxBatchBytes; the default is 16 MiB for local ones).
const RemoteMaxBatchBytes = 64 << 20

// Open builds the codec and the device of an unlocked provider: it verifies the header
// against mk (or, for Onetime, formats p), and runs the journal's recovery. It does not
// keep mk: the codec and the device hold the keys they derive, and Close wipes them.
func Open(p provider.Provider, mk *keys.MasterKey, opts Options) (*Volume, error) {
	var l layout.Layout
	var mode sector.Mode
	if o := opts.Onetime; o != nil {
		var err error
		mode = o.Mode
		l, err = layout.Plan(p.Size(), o.SectorSize, mode, 0)
		if err != nil {
			return nil, err
		}
		if err := blockdev.Format(p, l); err != nil {
			return nil, fmt.Errorf("prepare onetime volume: %w", err)
		}
	} else {
		h, err := keys.Read(p)
		if err != nil {
			return nil, err
		}
		if err := h.Verify(mk); err != nil {
			return nil, err
		}
		if err := h.Layout.Validate(p.Size()); err != nil {
			return nil, err
		}
		mode = h.Mode
		l = h.Layout
	}
	dk := mk.DataKey(mode)
	defer dk.Wipe()
	codec, err := sector.New(sector.Params{Mode: mode, SectorSize: l.SectorSize, Key: dk.Bytes(), VolumeID: mk.VolumeID()})
	if err != nil {
		return nil, err
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
	if provider.CapabilitiesOf(p).Shared {
		// A network provider: each commit costs several round trips whatever its size,
		// so larger batches carry more data per round trip (docs/benchmarks.md, "Remote
		// providers").
		cfg.MaxBatchBytes = RemoteMaxBatchBytes
	}
	dev, err := blockdev.Open(p, cfg)
	if err != nil {
		codec.Wipe()
		return nil, err
	}
	v := &Volume{dev: dev, codec: codec, mode: mode, ro: opts.ReadOnly, changed: make(chan struct{}, 1)}
	if f, ok := p.(Fencer); ok {
		v.fenced = f.Fenced
	}
	return v, nil
}

// Close commits what is pending, leaves an empty journal, syncs, and wipes the keys. Its
// error is the volume's final status: nil means every write it acknowledged is on the
// provider. It does not close the provider.
func (v *Volume) Close() error {
	err := v.dev.Close()
	v.codec.Wipe()
	return err
}

// Mode is the volume's cipher mode.
func (v *Volume) Mode() sector.Mode { return v.mode }

// SectorSize is the unit below which writes are read-modify-write.
func (v *Volume) SectorSize() int { return v.dev.SectorSize() }

// Recovery reports what opening the volume found in its journal.
func (v *Volume) Recovery() blockdev.Recovery { return v.dev.Recovery() }

// Err is the provider failure that stopped the volume, or nil.
func (v *Volume) Err() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.failed
}

// The nbd.Backend side. Flags and errors cross the seam here, and only here: nbd and
// blockdev each define their own, and nothing but this file knows that they correspond.

var (
	_ nbd.Backend = (*Volume)(nil)
	_ nbd.Cacher  = (*Volume)(nil)
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
	v.mu.Lock()
	v.lastErr, v.lastTime = err, time.Now()
	v.mu.Unlock()
	if write && !clientErr(err) {
		v.fail(err)
	}
	return nbdErr(err)
}

func (v *Volume) fail(err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.lastErr, v.lastTime = err, time.Now()
	if v.failed == nil {
		v.failed = err
		select {
		case v.changed <- struct{}{}:
		default:
		}
	}
}

func (v *Volume) Size() int64 { return v.dev.Size() }

// checkFence fails the volume once its provider is fenced, and says so for a write.
func (v *Volume) checkFence() error {
	if v.fenced == nil {
		return nil
	}
	if err := v.fenced(); err != nil {
		v.fail(err)
		return err
	}
	return nil
}

func (v *Volume) ReadAt(p []byte, off int64) error {
	v.reads.Add(1)
	err := v.dev.ReadAt(p, off)
	if err == nil {
		v.bytesRead.Add(uint64(len(p)))
	}
	return v.note(err, false)
}

func (v *Volume) WriteAt(p []byte, off int64, f nbd.Flags) error {
	v.writes.Add(1)
	if err := v.checkFence(); err != nil {
		return err
	}
	err := v.dev.WriteAt(p, off, devFlags(f))
	if err == nil {
		v.bytesWritten.Add(uint64(len(p)))
	}
	return v.note(err, true)
}

func (v *Volume) WriteZeroes(off, n int64, f nbd.Flags) error {
	v.zeroes.Add(1)
	if err := v.checkFence(); err != nil {
		return err
	}
	err := v.dev.WriteZeroes(off, n, devFlags(f))
	if errors.Is(err, blockdev.ErrSlowZero) {
		return err // the answer a FastZero request asks for, not a failure
	}
	return v.note(err, true)
}

func (v *Volume) Trim(off, n int64, f nbd.Flags) error {
	v.trims.Add(1)
	if err := v.checkFence(); err != nil {
		return err
	}
	return v.note(v.dev.Trim(off, n, devFlags(f)), true)
}

func (v *Volume) Flush() error {
	v.flushes.Add(1)
	if err := v.checkFence(); err != nil {
		return err
	}
	return v.note(v.dev.Flush(), true)
}

func (v *Volume) Cache(off, n int64) error {
	v.caches.Add(1)
	return v.note(v.dev.Cache(off, n), false)
}

package reencrypt

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// Online is a re-encryption of a device that serves clients meanwhile (an attached
// volume's). The process that serves the device holds the provider, so it writes the
// header's start, checkpoints and end; the keyslots' credentials, and their Argon2id
// work, stay with whoever asked for the re-encryption (keys.PrepareReencrypt). Run
// sweeps in steps that yield to clients; Pause holds it between steps, and so does a
// suspend of the device (blockdev.Device.Suspend).
//
// Online keeps the current master key for the header's checkpoints and end, from Start
// or Resume until Run ends or Close; for a suspend, DropKey wipes it and TakeKey gives it
// back (the device's Suspend and Resume hold the sweep meanwhile).
type Online struct {
	p        provider.Provider
	d        *blockdev.Device
	sw       *blockdev.Sweeper
	From, To sector.Mode
	Epoch    uint64

	mu      sync.Mutex
	mk      *keys.MasterKey // nil after DropKey (suspended), and once Run or Close ended
	closed  bool            // Run ended the re-encryption, or Close
	paused  bool            // Pause
	running bool            // Run is under way
}

// ErrSuspended: a header update asked of an Online whose keys were wiped by Suspend.
var ErrSuspended = errors.New("the volume is suspended: its keys are not in memory")

// StartOnline begins a re-encryption of d, open and serving on p, with the start pr
// prepared from p's header (keys.PrepareReencrypt, by the process that holds the
// credentials): it writes the header (keys.CommitReencrypt, which checks the start
// against p's header), then gives the device the new key, under which everything
// written from then on is sealed. It returns the new codec, which the device uses
// from now on and the caller wipes after closing the device; the device's codec until
// now becomes the previous one, which the caller may wipe once Run has returned nil.
// StartOnline keeps a copy of pr's key; the caller still wipes pr.
//
// A crash between the header's write and the device's switch leaves nothing under the
// new key: a header that says a re-encryption is under way at sector 0, which the next
// open resumes.
func StartOnline(p provider.Provider, d *blockdev.Device, pr *keys.PreparedReencrypt) (*Online, sector.Codec, error) {
	cur := d.Reencryption()
	if cur.Active {
		return nil, nil, fmt.Errorf("%w (at sector %d of %d)", keys.ErrReencrypting, cur.Cursor, cur.Sectors)
	}
	if err := keys.CommitReencrypt(p, pr); err != nil {
		return nil, nil, err
	}
	h, err := keys.Read(p)
	if err != nil {
		return nil, nil, fmt.Errorf("re-read the header after the re-encryption's start: %w", err)
	}
	mk, err := keys.NewMasterKey(pr.Key().VolumeID(), pr.Key().Bytes())
	if err != nil {
		return nil, nil, err
	}
	next, err := codec(mk, h.Mode, h.SectorSize)
	if err != nil {
		mk.Wipe()
		return nil, nil, err
	}
	jk := mk.JournalKey()
	defer jk.Wipe()
	r := h.Reencryption()
	if err := d.StartReencrypt(next, jk.Bytes(), r.Epoch); err != nil {
		next.Wipe()
		mk.Wipe()
		return nil, nil, fmt.Errorf("%w (the header says the re-encryption is under way: the next attach resumes it)", err)
	}
	return newOnline(p, d, mk, h), next, nil
}

// ResumeOnline takes up the re-encryption under way when d opened (Config.Reencrypt,
// from PreviousKeys of p's header): mk is the current master key, which it copies.
func ResumeOnline(p provider.Provider, d *blockdev.Device, mk *keys.MasterKey) (*Online, error) {
	if !d.Reencryption().Active {
		return nil, blockdev.ErrNotReencrypting
	}
	h, err := keys.Read(p)
	if err != nil {
		return nil, err
	}
	if err := h.Verify(mk); err != nil {
		return nil, err
	}
	if !h.Reencryption().Active {
		return nil, keys.ErrNotReencrypting
	}
	own, err := keys.NewMasterKey(mk.VolumeID(), mk.Bytes())
	if err != nil {
		return nil, err
	}
	return newOnline(p, d, own, h), nil
}

func newOnline(p provider.Provider, d *blockdev.Device, mk *keys.MasterKey, h *keys.Header) *Online {
	r := h.Reencryption()
	return &Online{p: p, d: d, mk: mk, From: r.PrevMode, To: h.Mode, Epoch: r.Epoch}
}

// Run sweeps until every sector is under the current key, then drops the previous key
// from the header and from the device, and wipes the master key it kept: nil then. If
// ctx ends first, it checkpoints and returns ctx's error; so does a failure. Run may be
// called again then (one at a time), and goes on from where the sweep stands, as the
// next open and ResumeOnline would from the checkpoint. cfg paces the sweep; its
// Checkpoint and Finish are Run's own.
func (o *Online) Run(ctx context.Context, cfg blockdev.SweeperConfig) error {
	cfg.Checkpoint = func(c uint64) error {
		return o.withKey(func(mk *keys.MasterKey) error { return keys.SetReencryptCursor(o.p, mk, c) })
	}
	cfg.Finish = func() error {
		return o.withKey(func(mk *keys.MasterKey) error { return keys.FinishReencrypt(o.p, mk) })
	}
	o.mu.Lock()
	switch {
	case o.running:
		o.mu.Unlock()
		return fmt.Errorf("%w: its sweep runs already", keys.ErrReencrypting)
	case o.closed:
		o.mu.Unlock()
		return errors.New("reencrypt: Online.Run after the end or Close")
	}
	o.running = true
	o.sw = blockdev.NewSweeper(o.d, cfg) // held from the start if the device is suspended
	if o.paused {
		o.sw.Pause()
	}
	o.mu.Unlock()
	err := o.sw.Run(ctx)
	o.mu.Lock()
	o.running = false
	o.mu.Unlock()
	if err == nil {
		o.Close()
	}
	return err
}

// withKey runs fn with the master key, or says the volume is suspended.
func (o *Online) withKey(fn func(*keys.MasterKey) error) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.mk == nil {
		return ErrSuspended
	}
	return fn(o.mk)
}

// Pause holds the sweep between steps and returns once no step runs; Resume lets it go
// on. A pause holds across the Runs that follow until Resume.
func (o *Online) Pause() {
	o.mu.Lock()
	o.paused = true
	sw := o.sw
	o.mu.Unlock()
	if sw != nil {
		sw.Pause()
	}
}

// Resume undoes Pause (a suspended device holds the sweep until its own Resume).
func (o *Online) Resume() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.paused = false
	if o.sw != nil {
		o.sw.Resume()
	}
}

// SetMaxRate bounds the running sweep to about bytesPerSecond (0: no bound), the rest
// it takes now included; false if no sweep runs.
func (o *Online) SetMaxRate(bytesPerSecond int64) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.running {
		return false
	}
	o.sw.SetMaxRate(bytesPerSecond)
	return true
}

// DropKey wipes the master key, for a suspend: Device.Suspend has recorded where the
// sweep stands (the checkpoint of the Sweeper it holds) and holds the sweep until
// Device.Resume, so nothing needs the key meanwhile; a checkpoint or an end asked all
// the same fails with ErrSuspended.
func (o *Online) DropKey() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.mk.Wipe()
	o.mk = nil
}

// TakeKey gives the master key back after DropKey, before Device.Resume lets the sweep
// go on: mk, unlocked again, must verify the volume's header; TakeKey copies it.
func (o *Online) TakeKey(mk *keys.MasterKey) error {
	h, err := keys.Read(o.p)
	if err != nil {
		return err
	}
	if err := h.Verify(mk); err != nil {
		return err
	}
	own, err := keys.NewMasterKey(mk.VolumeID(), mk.Bytes())
	if err != nil {
		return err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		own.Wipe()
		return nil
	}
	o.mk.Wipe()
	o.mk = own
	return nil
}

// Close wipes the master key. Call it once Run has returned.
func (o *Online) Close() {
	o.mu.Lock()
	o.mk.Wipe()
	o.mk, o.closed = nil, true
	o.mu.Unlock()
}

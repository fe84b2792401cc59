// Package reencrypt moves an eli volume's sectors to a new master key in place, and, for
// length-preserving modes, to another length-preserving mode (docs/design.md,
// "Re-encryption"): the header's part (keys: the new key wrapped into the keyslots, the
// previous one kept sealed until the end, the checkpoints) and the sweep's (blockdev)
// put together, and what is possible in place decided once, here.
package reencrypt

import (
	"context"
	"errors"
	"fmt"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// Check says whether a volume of header h can move to mode in place (zero: its own
// mode), with a message that says what to do instead: the layout must stay as it is. A
// format version 1 volume stays version 1 (version 2 nests a tree among the groups), an
// authenticated mode stays authenticated and a length-preserving one length-preserving,
// and the sector size stays. Mode none has no key: moving from none to none re-encrypts
// nothing.
func Check(h *keys.Header, mode sector.Mode) error {
	if mode == sector.ModeInvalid {
		mode = h.Mode
	}
	if err := keys.InPlace(h.Mode, mode); err != nil {
		return err
	}
	if h.Mode == sector.ModeNone && mode == sector.ModeNone {
		return fmt.Errorf("%w: mode none has no key, so there is nothing to re-encrypt (name a mode with --cipher)", keys.ErrModeChange)
	}
	return nil
}

// Keys are the keys a device of a volume opens with: the current codec and journal key,
// and while a re-encryption is under way the previous ones. Wipe them once the device is
// closed.
type Keys struct {
	Codec      sector.Codec
	JournalKey *keys.Secret
	// Reencrypt is nil unless the header says a re-encryption is under way.
	*Previous
}

// Previous is a re-encryption's previous keys, for blockdev.Config.Reencrypt.
type Previous struct {
	Reencrypt *blockdev.Reencrypt
	codec     sector.Codec
	journal   *keys.Secret
}

// DeviceKeys derives the keys of h, unlocked with mk (the current master key).
func DeviceKeys(h *keys.Header, mk *keys.MasterKey) (*Keys, error) {
	k := &Keys{}
	var err error
	if k.Codec, err = codec(mk, h.Mode, h.SectorSize); err != nil {
		return nil, err
	}
	k.JournalKey = mk.JournalKey()
	if k.Previous, err = PreviousKeys(h, mk); err != nil {
		k.Wipe()
		return nil, err
	}
	return k, nil
}

// PreviousKeys derives the previous keys of h, unlocked with mk, while the header says a
// re-encryption is under way (nil otherwise: nothing to add to a device's keys).
func PreviousKeys(h *keys.Header, mk *keys.MasterKey) (*Previous, error) {
	r := h.Reencryption()
	if !r.Active {
		return nil, nil
	}
	prev, err := h.PreviousKey(mk)
	if err != nil {
		return nil, err
	}
	defer prev.Wipe()
	p := &Previous{}
	if p.codec, err = codec(prev, r.PrevMode, h.SectorSize); err != nil {
		return nil, err
	}
	p.journal = prev.JournalKey()
	p.Reencrypt = &blockdev.Reencrypt{Prev: p.codec, PrevJournalKey: p.journal.Bytes(), Epoch: r.Epoch, Cursor: r.Cursor}
	return p, nil
}

// Wipe zeroes the previous keys (nil: nothing).
func (p *Previous) Wipe() {
	if p != nil {
		p.codec.Wipe()
		p.journal.Wipe()
	}
}

func codec(mk *keys.MasterKey, mode sector.Mode, sectorSize int) (sector.Codec, error) {
	dk := mk.DataKey(mode)
	defer dk.Wipe()
	return sector.New(sector.Params{Mode: mode, SectorSize: sectorSize, Key: dk.Bytes(), VolumeID: mk.VolumeID()})
}

// Apply puts the keys into a device's configuration. Open copies the journal keys; the
// codecs stay the Keys'.
func (k *Keys) Apply(cfg *blockdev.Config) {
	cfg.Codec, cfg.JournalKey, cfg.Reencrypt = k.Codec, k.JournalKey.Bytes(), nil
	if k.Previous != nil {
		cfg.Reencrypt = k.Reencrypt
	}
}

// Wipe zeroes every key.
func (k *Keys) Wipe() {
	k.Codec.Wipe()
	k.JournalKey.Wipe()
	k.Previous.Wipe()
}

// Options say how Run re-encrypts.
type Options struct {
	// Header: how a new re-encryption re-wraps the keyslots, and into which mode.
	// Ignored when one is under way already (Run resumes it).
	Header keys.ReencryptOptions
	// Sweep paces the sweep; its Checkpoint and Finish are Run's own.
	Sweep blockdev.SweeperConfig
	// Device is the rest of the device's configuration (cache, logger).
	Device blockdev.Config
}

// Result is what Run did.
type Result struct {
	// Resumed: the header said a re-encryption was under way, and Run finished it.
	Resumed bool
	// Epoch is the volume's key epoch now; From and To the modes.
	Epoch    uint64
	From, To sector.Mode
	// Moved and Unreadable are the sweep's counts (blockdev.ReencryptStatus) in this run.
	Moved, Unreadable uint64
}

// Run re-encrypts the detached provider p, unlocked with mk (the master key the
// keyslots open): it begins a re-encryption in the header (a new master key; the
// header's keyslots re-wrapped as opts.Header says), or resumes the one under way, then
// opens the device with both keys, sweeps with checkpoints in the header, and ends by
// dropping the previous key from the header. The caller holds p's locks. If ctx ends
// first, Run checkpoints and returns ctx's error: the next Run resumes there.
func Run(ctx context.Context, p provider.Provider, mk *keys.MasterKey, opts Options) (Result, error) {
	h, err := keys.Read(p)
	if err != nil {
		return Result{}, err
	}
	res := Result{From: h.Mode, To: h.Mode}
	cur := mk
	if r := h.Reencryption(); r.Active {
		res.Resumed, res.From = true, r.PrevMode
		if opts.Header.Mode != sector.ModeInvalid && opts.Header.Mode != h.Mode {
			return res, fmt.Errorf("%w from %s to %s is under way: finish it before asking for %s", keys.ErrReencrypting, r.PrevMode, h.Mode, opts.Header.Mode)
		}
	} else {
		if err := Check(h, opts.Header.Mode); err != nil {
			return res, err
		}
		if cur, err = keys.BeginReencrypt(p, mk, opts.Header); err != nil {
			return res, err
		}
		defer cur.Wipe()
		if h, err = keys.Read(p); err != nil {
			return res, err
		}
		res.To = h.Mode
	}
	res.Epoch = h.Reencryption().Epoch
	k, err := DeviceKeys(h, cur)
	if err != nil {
		return res, err
	}
	defer k.Wipe()
	cfg := opts.Device
	cfg.Layout = h.Layout
	k.Apply(&cfg)
	d, err := blockdev.Open(p, cfg)
	if err != nil {
		return res, err
	}
	sc := opts.Sweep
	progress := sc.OnProgress
	sc.OnProgress = func(st blockdev.ReencryptStatus) {
		if st.Active {
			res.Moved, res.Unreadable = st.Moved, st.Unreadable
		}
		if progress != nil {
			progress(st)
		}
	}
	sc.Checkpoint = func(c uint64) error { return keys.SetReencryptCursor(p, cur, c) }
	sc.Finish = func() error { return keys.FinishReencrypt(p, cur) }
	err = blockdev.NewSweeper(d, sc).Run(ctx)
	if cerr := d.Close(); cerr != nil && err == nil {
		err = cerr
	}
	if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%w (run eli reencrypt again to resume from the last checkpoint)", err)
	}
	return res, err
}

package keys

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
)

// Create writes a new header for layout l to p (both copies, and zeroes over the reserved
// area up to offset 65536) with a fresh random volume ID and master key wrapped into
// keyslot 0 under c and kdf. It returns the master key; the caller wipes it.
//
// Create does not look at what p held before (the CLI decides whether to overwrite an
// existing volume), and it writes nothing past offset 65536 except copy B: clearing the
// journal and the metadata blocks of the data area is the caller's job. Errors wrap
// ErrLayout, ErrTooSmall, ErrNoCredentials or ErrKDFParams, or are I/O errors.
func Create(p provider.Provider, l Layout, c Credentials, kdf KDFParams) (*MasterKey, error) {
	return create(p, l, c, kdf, rand.Reader)
}

func create(p provider.Provider, l Layout, c Credentials, kdf KDFParams, rnd io.Reader) (*MasterKey, error) {
	if err := l.Validate(p.Size()); err != nil {
		return nil, err
	}
	if err := c.check(); err != nil {
		return nil, err
	}
	if err := kdf.Validate(); err != nil {
		return nil, err
	}
	mk, err := generateMasterKey(rnd)
	if err != nil {
		return nil, err
	}
	var raw [HeaderSize]byte
	encodeBase(&raw, l, mk.volumeID, p.Size())
	setMAC(&raw, mk)
	if err := sealSlot(&raw, 0, mk, c, kdf, rnd); err != nil {
		mk.Wipe()
		return nil, err
	}
	if _, err := p.WriteAt(make([]byte, layout.HeaderRegionLen-HeaderSize), HeaderSize); err != nil {
		mk.Wipe()
		return nil, fmt.Errorf("clear the reserved area after header copy A: %w", err)
	}
	if err := finish(p, &raw, 1, aThenB); err != nil {
		mk.Wipe()
		return nil, err
	}
	return mk, nil
}

// update re-reads the header, lets change edit a copy of the winning copy's bytes, and
// writes the result as both copies with the next sequence number (which also repairs a
// missing, corrupt or older copy).
func update(p provider.Provider, change func(h *Header, raw *[HeaderSize]byte) error) error {
	h, err := Read(p)
	if err != nil {
		return err
	}
	raw := h.raw
	if err := change(h, &raw); err != nil {
		return err
	}
	return writeBoth(p, h, &raw, h.Sequence)
}

// writeBoth writes raw, an edit of h, as both copies with the sequence after the given
// ones, then zeroes a copy B that a grown provider left behind. The copy h was read from
// is written last: when the other one is corrupt (a crash tore it in an earlier update),
// writing h's copy first would leave no valid copy if this write were torn too.
func writeBoth(p provider.Provider, h *Header, raw *[HeaderSize]byte, after ...uint64) error {
	seq, err := nextSequence(after...)
	if err != nil {
		return err
	}
	if err := finish(p, raw, seq, lastOf(h.Copy)); err != nil {
		return err
	}
	return wipeStrayCopy(p, h.ProviderSize, h.rawVolumeID())
}

// SetKey wraps the master key into a keyslot under new credentials and KDF parameters:
// slot AnySlot takes the first empty slot (ErrNoFreeSlot if none), slot 0..7 is written
// whether or not it is in use (replacing its old credentials). mk must be this volume's
// key (from Unlock). It returns the slot written.
func SetKey(p provider.Provider, mk *MasterKey, slot int, c Credentials, kdf KDFParams) (int, error) {
	return setKey(p, mk, slot, c, kdf, rand.Reader)
}

func setKey(p provider.Provider, mk *MasterKey, slot int, c Credentials, kdf KDFParams, rnd io.Reader) (int, error) {
	if err := c.check(); err != nil {
		return -1, err
	}
	if err := kdf.Validate(); err != nil {
		return -1, err
	}
	if slot != AnySlot && (slot < 0 || slot >= NumSlots) {
		return -1, newError(ErrSlotRange, "keyslot %d is out of range (0..%d)", slot, NumSlots-1)
	}
	used := slot
	err := update(p, func(h *Header, raw *[HeaderSize]byte) error {
		if err := h.Verify(mk); err != nil {
			return err
		}
		if used == AnySlot {
			for i := range NumSlots {
				if !h.slot(i).Active {
					used = i
					break
				}
			}
			if used == AnySlot {
				return newError(ErrNoFreeSlot, "no free keyslot: all %d are in use (delete one with eli delkey, or replace one by number)", NumSlots)
			}
		}
		return sealSlot(raw, used, mk, c, kdf, rnd)
	})
	if err != nil {
		return -1, err
	}
	return used, nil
}

// DelKey empties keyslot slot. It needs no key (as geli delkey): whoever can write the
// provider can destroy it anyway. Deleting the last active slot makes the volume
// unopenable, so it is refused with ErrLastSlot unless force.
func DelKey(p provider.Provider, slot int, force bool) error {
	if slot < 0 || slot >= NumSlots {
		return newError(ErrSlotRange, "keyslot %d is out of range (0..%d)", slot, NumSlots-1)
	}
	return update(p, func(h *Header, raw *[HeaderSize]byte) error {
		if !h.slot(slot).Active {
			return newError(ErrSlotEmpty, "keyslot %d is empty", slot)
		}
		active := 0
		for i := range NumSlots {
			if h.slot(i).Active {
				active++
			}
		}
		if active == 1 && !force {
			return newError(ErrLastSlot, "refusing to delete keyslot %d, the last active keyslot: nothing could unlock the volume afterwards", slot)
		}
		clear(slotBytes(raw, slot))
		return nil
	})
}

// Kill destroys every keyslot in both header copies, and a re-encryption's previous
// master key, so nothing can unlock the volume any more; the rest of the header stays, so eli dump still says what the provider was. A
// copy that is corrupt but still carries the magic and version 1 or 2 gets its keyslot area
// zeroed in place. Kill refuses a provider with no eli header (ErrNotELI) or only one of
// an unknown version (ErrVersion), whose keyslot area it cannot know.
func Kill(p provider.Provider) error {
	cs, err := readCopies(p)
	if err != nil {
		return err
	}
	h, herr := choose(p, cs)
	if herr == nil {
		raw := h.raw
		clear(raw[offSlots:offReserved])
		clearReencryption(&raw) // the previous master key too
		return writeBoth(p, h, &raw, h.Sequence)
	}
	if errors.Is(herr, ErrNotELI) || errors.Is(herr, ErrVersion) || kindOf(herr) == nil {
		return herr
	}
	killed := false
	for _, c := range cs {
		if c.raw == nil || !bytes.HasPrefix(c.raw, magic[:]) || !knownVersion(binary.LittleEndian.Uint32(c.raw[offVersion:])) {
			continue
		}
		if _, err := p.WriteAt(make([]byte, offAreaEnd-offSlots), c.off+offSlots); err != nil {
			return fmt.Errorf("zero the keyslots of header copy %s: %w", c.which, err)
		}
		killed = true
	}
	if !killed {
		return herr
	}
	if err := p.Sync(); err != nil {
		return fmt.Errorf("sync after zeroing keyslots: %w", err)
	}
	return nil
}

// Restore writes a backup (as from Header.Backup) as both header copies of p, with a
// sequence number above every current copy's so that it wins even if the restore is torn.
//
// The backup must decode (magic, version, checksum, sanity) and its layout must fit p
// (ErrTooSmall; never overridden: no reader would accept the result). Unless force, it
// must also belong to the volume of any header copy p holds now (ErrOtherVolume), and
// have been made when the provider had its present size (ErrSizeMismatch: restoring a
// header from before a resize would hide the grown part), and hold no master key that
// a re-encryption has moved the data off since (ErrOldKeys: a backup of an older key
// epoch, or one made during a re-encryption that has finished).
func Restore(p provider.Provider, backup []byte, force bool) error {
	hb, err := Decode(backup)
	if err != nil {
		return fmt.Errorf("backup: %w", err)
	}
	if err := hb.Layout.Validate(p.Size()); err != nil {
		return fmt.Errorf("backup: %w", err)
	}
	cs, err := readCopies(p)
	if err != nil {
		return err
	}
	seqs := []uint64{hb.Sequence}
	for _, c := range cs {
		if c.h == nil {
			continue
		}
		seqs = append(seqs, c.h.Sequence)
		if id := c.h.rawVolumeID(); !force && id != hb.rawVolumeID() {
			return newError(ErrOtherVolume, "the backup belongs to volume %x, but header copy %s of the provider is of volume %x", hb.rawVolumeID(), c.which, id)
		}
		if err := staleBackup(hb.Reencryption(), c.h.Reencryption()); err != nil && !force {
			return err
		}
	}
	if !force && hb.ProviderSize != p.Size() {
		return newError(ErrSizeMismatch, "the backup was written when the provider had %d bytes; it has %d now", hb.ProviderSize, p.Size())
	}
	raw := hb.raw
	if cur, err := choose(p, cs); err == nil {
		hb.Copy = cur.Copy // the copy to keep until the other is down
	}
	return writeBoth(p, hb, &raw, seqs...)
}

// Resize records a new sector count and the provider's present size (after the provider
// has grown), re-MACs the header under mk and moves copy B to the new end. It refuses to
// shrink the sector count (ErrLayout) and a count that does not fit (ErrTooSmall).
//
// Order: first the copy B at the old end is zeroed (it lies where the data area grows;
// copy A stays good meanwhile), then the new copy B is written at the new end and synced,
// then copy A. A crash at any point leaves one good copy: the old A or the new B.
func Resize(p provider.Provider, mk *MasterKey, sectors uint64) error {
	h, err := Read(p)
	if err != nil {
		return err
	}
	if err := h.Verify(mk); err != nil {
		return err
	}
	if sectors < h.Sectors {
		return newError(ErrLayout, "refusing to shrink the volume from %d to %d sectors", h.Sectors, sectors)
	}
	l := h.Layout
	l.Sectors = sectors
	if err := l.Validate(p.Size()); err != nil {
		return err
	}
	if err := wipeStrayCopy(p, h.ProviderSize, h.rawVolumeID()); err != nil {
		return err
	}
	raw := h.raw
	binary.LittleEndian.PutUint64(raw[offSectors:], sectors)
	binary.LittleEndian.PutUint64(raw[offProvider:], uint64(p.Size()))
	setMAC(&raw, mk)
	seq, err := nextSequence(h.Sequence)
	if err != nil {
		return err
	}
	return finish(p, &raw, seq, bThenA)
}

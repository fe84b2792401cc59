package keys

import (
	"bytes"
	"fmt"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/provider"
)

// writeOrder is the order the two copies are written in. Each write is followed by a sync,
// so a crash at any point leaves at least one complete copy: the new one or the old one.
type writeOrder int

const (
	aThenB writeOrder = iota // copy B is the valid one to keep, or neither is
	bThenA                   // copy A is the valid one to keep (resize: copy B moves, the old copy A stays good until B is down)
)

// lastOf is the order that writes copy c last, so that it stays good until the other
// copy is written and synced.
func lastOf(c Copy) writeOrder {
	if c == CopyA {
		return bThenA
	}
	return aThenB
}

// writeCopies writes raw (sequence and checksum already set) as both header copies of p.
func writeCopies(p provider.Provider, raw *[HeaderSize]byte, order writeOrder) error {
	offB := layout.HeaderBOffset(p.Size())
	if offB < 0 {
		return newError(ErrTooSmall, "a provider of %d bytes has no room for header copy B", p.Size())
	}
	type loc struct {
		c   Copy
		off int64
	}
	locs := []loc{{CopyA, 0}, {CopyB, offB}}
	if order == bThenA {
		locs[0], locs[1] = locs[1], locs[0]
	}
	for _, l := range locs {
		if _, err := p.WriteAt(raw[:], l.off); err != nil {
			return fmt.Errorf("write header copy %s at offset %d: %w", l.c, l.off, err)
		}
		if err := p.Sync(); err != nil {
			return fmt.Errorf("sync header copy %s: %w", l.c, err)
		}
	}
	return nil
}

// wipeStrayCopy zeroes the copy B that a provider of oldSize bytes had, if the provider
// has grown past it and it still holds this volume's header: it carries keyslots that
// later setkey/delkey/kill would otherwise never touch. That place lies outside the data
// area of any layout that fits oldSize (Decode checks that N fits the recorded size), so
// zeroing it loses no data.
func wipeStrayCopy(p provider.Provider, oldSize int64, volumeID [16]byte) error {
	old := layout.HeaderBOffset(oldSize)
	if old < 0 || old == layout.HeaderBOffset(p.Size()) || old+HeaderSize > p.Size() {
		return nil
	}
	b := make([]byte, HeaderSize)
	if err := readAt(p, b, old); err != nil {
		return fmt.Errorf("read old header copy B: %w", err)
	}
	if !bytes.HasPrefix(b, magic[:]) || !bytes.Equal(b[offVolumeID:offVolumeID+16], volumeID[:]) {
		return nil
	}
	clear(b)
	if _, err := p.WriteAt(b, old); err != nil {
		return fmt.Errorf("wipe old header copy B at offset %d: %w", old, err)
	}
	if err := p.Sync(); err != nil {
		return fmt.Errorf("sync after wiping old header copy B: %w", err)
	}
	return nil
}

// finish sets the sequence and checksum of an updated header, re-checks it with the same
// decoder readers use (so this package never writes a header it would refuse), and
// writes it.
func finish(p provider.Provider, raw *[HeaderSize]byte, seq uint64, order writeOrder) error {
	setSequence(raw, seq)
	setChecksum(raw)
	h, err := decode(raw[:], "")
	if err != nil {
		return fmt.Errorf("internal error: the updated header does not decode: %w", err)
	}
	if err := h.Layout.Validate(p.Size()); err != nil {
		return err
	}
	return writeCopies(p, raw, order)
}

// nextSequence is the sequence number that makes a new header win over every valid copy.
func nextSequence(seqs ...uint64) (uint64, error) {
	var m uint64
	for _, s := range seqs {
		m = max(m, s)
	}
	if m == ^uint64(0) {
		return 0, newError(ErrCorrupt, "header sequence number is exhausted")
	}
	return m + 1, nil
}

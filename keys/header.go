package keys

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

// Byte offsets inside a header copy (docs/format.md, "Header").
const (
	offVersion    = 8
	offLength     = 12
	offSequence   = 16
	offVolumeID   = 24
	offMode       = 40
	offSectorSize = 44
	offDataOffset = 48
	offJournalOff = 56
	offJournalLen = 64
	offFlags      = 72
	offSlotCount  = 76
	offSectors    = 80
	offProvider   = 88
	offMAC        = 96
	offSlots      = 128
	offReserved   = offSlots + NumSlots*slotSize // 1664
	offChecksum   = HeaderSize - sha256.Size     // 4064

	macSize = 32
	// slotADFields is the end of the header prefix that every keyslot's AD covers.
	slotADFields = offSectors
)

// magic is "\x89ELI\r\n\x1a\n": the high byte and the line endings catch transfers that
// mangle binary data, as PNG's signature does.
// maxPlausibleVersion is the largest version number Decode reports as a newer format
// rather than as corruption.
const maxPlausibleVersion = 255

var magic = [8]byte{0x89, 'E', 'L', 'I', '\r', '\n', 0x1a, '\n'}

// Copy names one of the two header copies.
type Copy uint8

const (
	CopyNone Copy = iota // not read from a provider (Decode of a backup)
	CopyA                // at offset 0
	CopyB                // at the end of the provider
)

func (c Copy) String() string {
	switch c {
	case CopyA:
		return "A"
	case CopyB:
		return "B"
	}
	return "none"
}

// Header is a decoded header copy. Changing its fields changes nothing: every operation
// that writes the header re-reads it from the provider, and Unlock and Backup work on the
// bytes that were decoded, not on these fields.
type Header struct {
	Layout                // mode, sector size, D, J, N; Layout.Version is 0 for version 1
	Version      uint32   // format version (1, or 2 for a hash tree over the metadata)
	Sequence     uint64   // incremented by every header update; the higher copy wins
	VolumeID     [16]byte // random at init
	ProviderSize int64    // provider size when N was last set (informative)
	Slots        [NumSlots]SlotInfo

	// Copy is the copy Read decoded (CopyNone for Decode). Offset is its byte offset.
	Copy   Copy
	Offset int64
	// Warning says what is wrong with the other copy (missing, corrupt, older), or is nil
	// when both copies are good and equal. It wraps ErrNotELI, ErrVersion, ErrCorrupt,
	// ErrTooSmall or ErrStale. The next header update rewrites that copy.
	Warning error

	raw [HeaderSize]byte
}

// Backup returns the decoded header copy's bytes: the content of a backup file.
func (h *Header) Backup() []byte { return bytes.Clone(h.raw[:]) }

// ActiveSlots is the number of keyslots in use.
func (h *Header) ActiveSlots() int {
	n := 0
	for _, s := range h.Slots {
		if s.Active {
			n++
		}
	}
	return n
}

// Decode parses a header copy or backup file (exactly HeaderSize bytes) and checks its
// magic, version, length, checksum and field sanity. It does not check the layout against
// a provider (Restore does), nor the MAC (Unlock does). Errors wrap ErrNotELI, ErrVersion
// or ErrCorrupt.
func Decode(b []byte) (*Header, error) {
	return decode(b, "")
}

// decode is Decode with where (" at offset N", or "") placed into error messages.
func decode(b []byte, where string) (*Header, error) {
	corrupt := func(format string, a ...any) error {
		what := "eli header"
		if where != "" {
			what = "eli header copy" + where
		}
		return newError(ErrCorrupt, "%s is corrupt (%s)", what, fmt.Sprintf(format, a...))
	}
	if len(b) < len(magic) || !bytes.Equal(b[:len(magic)], magic[:]) {
		return nil, newError(ErrNotELI, "no eli header%s", where)
	}
	if len(b) != HeaderSize {
		return nil, corrupt("%d bytes, expected %d", len(b), HeaderSize)
	}
	le := binary.LittleEndian
	v := le.Uint32(b[offVersion:])
	if v != FormatVersion && v != FormatVersion2 {
		// A later format may move the checksum, so a small version number is taken at its
		// word; a huge one next to a bad checksum is damage, not the future.
		if sum := sha256.Sum256(b[:offChecksum]); v > maxPlausibleVersion && !bytes.Equal(sum[:], b[offChecksum:]) {
			return nil, corrupt("checksum mismatch, and version field %d", v)
		}
		return nil, newError(ErrVersion, "eli header version %d%s is not supported (this eli reads versions %d and %d)", v, where, FormatVersion, FormatVersion2)
	}
	if n := le.Uint32(b[offLength:]); n != HeaderSize {
		return nil, corrupt("header length field is %d, expected %d", n, HeaderSize)
	}
	if sum := sha256.Sum256(b[:offChecksum]); !bytes.Equal(sum[:], b[offChecksum:]) {
		return nil, corrupt("checksum mismatch")
	}

	// From here on the bytes are as some writer meant them; what follows refuses a writer
	// that is not eli version 1 or 2 (or an attacker who recomputed the checksum) before
	// any value is used. The version is covered by the MAC, so that a version 2 header
	// rewritten as version 1, to shed its hash tree, fails Unlock.
	h := &Header{Version: v}
	if v == FormatVersion2 {
		h.Layout.Version = layout.Version2
	}
	copy(h.raw[:], b)
	h.Sequence = le.Uint64(b[offSequence:])
	copy(h.VolumeID[:], b[offVolumeID:])
	h.Mode = sector.Mode(b[offMode])
	if !h.Mode.Valid() {
		return nil, corrupt("unknown cipher mode %d", b[offMode])
	}
	if !allZero(b[offMode+1 : offSectorSize]) {
		return nil, corrupt("reserved bytes after the mode are not zero")
	}
	s := le.Uint32(b[offSectorSize:])
	if s > sector.MaxSectorSize || !sector.ValidSectorSize(int(s)) {
		return nil, corrupt("sector size %d is not a power of two from %d to %d", s, sector.MinSectorSize, sector.MaxSectorSize)
	}
	h.SectorSize = int(s)
	for _, f := range []struct {
		off  int
		name string
		dst  *int64
	}{
		{offDataOffset, "data offset", &h.DataOffset},
		{offJournalLen, "journal length", &h.JournalLen},
		{offProvider, "provider size", &h.ProviderSize},
	} {
		v := le.Uint64(b[f.off:])
		if v > math.MaxInt64 {
			return nil, corrupt("%s %d is out of range", f.name, v)
		}
		*f.dst = int64(v)
	}
	h.Sectors = le.Uint64(b[offSectors:])
	if jo := le.Uint64(b[offJournalOff:]); jo != uint64(h.JournalOffset()) {
		return nil, corrupt("journal offset %d does not match journal length %d", jo, h.JournalLen)
	}
	if n := le.Uint32(b[offSlotCount:]); n != NumSlots {
		return nil, corrupt("keyslot count %d, expected %d", n, NumSlots)
	}
	if err := h.Layout.Check(); err != nil {
		return nil, corrupt("%v", err)
	}
	// N was set for the recorded provider size, so the layout fits it; Resize relies on
	// this to know that the copy B of that size lies outside the data area.
	if err := h.Layout.Validate(h.ProviderSize); err != nil {
		return nil, corrupt("recorded provider size %d cannot hold the layout", h.ProviderSize)
	}
	if err := checkReencryption(b, h.Layout); err != nil {
		return nil, corrupt("%v", err)
	}
	for i := range NumSlots {
		info, err := decodeSlot(slotBytes(&h.raw, i))
		if err != nil {
			return nil, corrupt("keyslot %d: %v", i, err)
		}
		h.Slots[i] = info
	}
	return h, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// encodeBase fills the fixed fields of a new header (no MAC, slots or checksum yet).
func encodeBase(raw *[HeaderSize]byte, l Layout, volumeID [16]byte, providerSize int64) {
	le := binary.LittleEndian
	*raw = [HeaderSize]byte{}
	copy(raw[:], magic[:])
	le.PutUint32(raw[offVersion:], l.FormatVersion())
	le.PutUint32(raw[offLength:], HeaderSize)
	le.PutUint64(raw[offSequence:], 1)
	copy(raw[offVolumeID:], volumeID[:])
	raw[offMode] = byte(l.Mode)
	le.PutUint32(raw[offSectorSize:], uint32(l.SectorSize))
	le.PutUint64(raw[offDataOffset:], uint64(l.DataOffset))
	le.PutUint64(raw[offJournalOff:], uint64(l.JournalOffset()))
	le.PutUint64(raw[offJournalLen:], uint64(l.JournalLen))
	le.PutUint32(raw[offSlotCount:], NumSlots)
	le.PutUint64(raw[offSectors:], l.Sectors)
	le.PutUint64(raw[offProvider:], uint64(providerSize))
}

func setSequence(raw *[HeaderSize]byte, seq uint64) {
	binary.LittleEndian.PutUint64(raw[offSequence:], seq)
}

func setChecksum(raw *[HeaderSize]byte) {
	sum := sha256.Sum256(raw[:offChecksum])
	copy(raw[offChecksum:], sum[:])
}

// authenticatedPrefix returns header bytes [0, n) with the sequence zeroed: the part of
// the header that the MAC (n = 96) and every keyslot's AD (n = 80) cover. The sequence is
// left out so that updates which need no key (delkey, kill) can still bump it.
func authenticatedPrefix(raw *[HeaderSize]byte, n int) []byte {
	p := bytes.Clone(raw[:n])
	clear(p[offSequence : offSequence+8])
	return p
}

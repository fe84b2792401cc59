package keys

import (
	"math"

	"github.com/elidisk/eli/sector"
)

// Format constants from docs/format.md.
const (
	// HeaderSize is the length of one header copy and of a backup file.
	HeaderSize = 4096
	// NumSlots is the number of keyslots in a header.
	NumSlots = 8
	// FormatVersion is the header format version this package reads and writes.
	FormatVersion = 1
	// JournalOffset is where the journal starts when there is one.
	JournalOffset = 65536

	// unit is the alignment of the journal, the data area and its end.
	unit = 65536
	// recordSize is the metadata record of an authenticated sector (nonce ‖ tag).
	recordSize = 40
	// maxJournal bounds J so that no arithmetic on a hostile header can overflow.
	maxJournal = 1 << 40
)

// Layout is what the caller (the CLI, through blockdev) decides about a new volume: the
// fields of the header that place the journal and the data area. See docs/format.md.
type Layout struct {
	Mode          sector.Mode
	SectorSize    int
	DataOffset    int64  // D: a multiple of 65536, at least 65536 + JournalLength
	JournalLength int64  // J: a multiple of 65536; > 0 for authenticated modes, 0 otherwise
	Sectors       uint64 // N: data sectors exposed, at least 1
}

// JournalOffset is the header's journal offset field: 65536, or 0 without a journal.
func (l Layout) JournalOffset() int64 {
	if l.JournalLength == 0 {
		return 0
	}
	return JournalOffset
}

// DataLimit is E for a provider of size bytes: the offset the data area must end at or
// before, so that it never shares a 64 KiB unit with header copy B. It is negative when
// the provider cannot hold header copy B past header copy A.
func DataLimit(size int64) int64 {
	t := copyBOffset(size)
	if t < 0 {
		return -1
	}
	return t - t%unit
}

// copyBOffset is T, header copy B's offset for a provider of size bytes, or -1 when the
// provider is too small for a copy B that does not overlap copy A.
func copyBOffset(size int64) int64 {
	t := size - size%HeaderSize - HeaderSize
	if t < HeaderSize {
		return -1
	}
	return t
}

// check validates the layout on its own (not against a provider). The error wraps
// ErrLayout and names the field.
func (l Layout) check() error {
	if !l.Mode.Valid() {
		return newError(ErrLayout, "mode %d is not a known cipher mode", uint8(l.Mode))
	}
	if !sector.ValidSectorSize(l.SectorSize) {
		return newError(ErrLayout, "sector size %d is not a power of two from %d to %d",
			l.SectorSize, sector.MinSectorSize, sector.MaxSectorSize)
	}
	j := l.JournalLength
	if j < 0 || j > maxJournal || j%unit != 0 {
		return newError(ErrLayout, "journal length %d is not a multiple of %d up to %d", j, unit, int64(maxJournal))
	}
	if l.Mode.Authenticated() && j == 0 {
		return newError(ErrLayout, "mode %s needs a journal (journal length is 0)", l.Mode)
	}
	if !l.Mode.Authenticated() && j != 0 {
		return newError(ErrLayout, "mode %s has no journal, but the journal length is %d", l.Mode, j)
	}
	d := l.DataOffset
	if d%unit != 0 || d < JournalOffset+j || d > math.MaxInt64/2 {
		return newError(ErrLayout, "data offset %d is not a multiple of %d at or after the journal's end (%d)", d, unit, JournalOffset+j)
	}
	if l.Sectors == 0 {
		return newError(ErrLayout, "sector count is 0: a volume holds at least one sector")
	}
	if _, ok := l.dataEnd(); !ok {
		return newError(ErrLayout, "%d sectors of %d bytes at offset %d overflow a 64-bit offset", l.Sectors, l.SectorSize, d)
	}
	return nil
}

// fits reports whether the layout's data area ends within DataLimit(size); the error
// wraps ErrTooSmall. It assumes check passed.
func (l Layout) fits(size int64) error {
	end, _ := l.dataEnd()
	if limit := DataLimit(size); end > limit {
		return newError(ErrTooSmall, "%d sectors of %d bytes (%s) need the data area to end at %d, but a provider of %d bytes leaves room up to %d",
			l.Sectors, l.SectorSize, l.Mode, end, size, max(limit, 0))
	}
	return nil
}

// Validate checks the layout against the format and against a provider of size bytes.
// Errors wrap ErrLayout or ErrTooSmall.
func (l Layout) Validate(size int64) error {
	if err := l.check(); err != nil {
		return err
	}
	return l.fits(size)
}

// dataEnd is D + span(N), with ok false on overflow.
func (l Layout) dataEnd() (int64, bool) {
	span, ok := dataSpan(l.Mode, l.SectorSize, l.Sectors)
	if !ok || span > math.MaxInt64-l.DataOffset {
		return 0, false
	}
	return l.DataOffset + span, true
}

// dataSpan is span(N) from docs/format.md, with ok false when it overflows an int64.
func dataSpan(m sector.Mode, s int, n uint64) (int64, bool) {
	ss := uint64(s)
	if m.MetaSize() == 0 {
		if n > math.MaxInt64/ss {
			return 0, false
		}
		return int64(n * ss), true
	}
	meta := uint64(max(s, 4096))
	r := meta / recordSize
	g := meta + r*ss
	full, rest := n/r, n%r
	if full > math.MaxInt64/g {
		return 0, false
	}
	span := full * g
	if rest > 0 {
		tail := meta + rest*ss // < g, no overflow
		if span > math.MaxInt64-tail {
			return 0, false
		}
		span += tail
	}
	return int64(span), true
}

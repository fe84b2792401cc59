package blockdev

import (
	"fmt"
	"math"

	"github.com/elidisk/eli/sector"
)

// Fixed offsets and sizes of docs/format.md ("Regions").
const (
	// HeaderRegionLen is header copy A plus the reserved area; the journal (or, without
	// one, the data area) starts right after it.
	HeaderRegionLen = 65536
	// HeaderCopyLen is the length of one header copy (B sits in the last whole 4 KiB).
	HeaderCopyLen = 4096
	// JournalAlign is the unit of the journal's length and of the data area's end.
	JournalAlign = 65536
	// DefaultJournalLen holds about 23800 entries (a 93 MiB batch of 4 KiB sectors).
	DefaultJournalLen = 2 << 20
	// MaxJournalLen bounds the journal, which recovery reads whole into memory.
	MaxJournalLen = 64 << 20
	// RecordSize is MetaSize of the authenticated modes.
	RecordSize = 40
)

// Layout is where a volume's journal, metadata and data live on its provider. keys/ stores
// its fields in the header; PlanLayout computes them for a new or resized provider.
type Layout struct {
	SectorSize    int    // S: a power of two, 512 to 65536
	MetaSize      int    // bytes of metadata per sector: 0 (length-preserving) or RecordSize
	DataOffset    int64  // D
	JournalOffset int64  // HeaderRegionLen, or 0 when JournalLen is 0
	JournalLen    int64  // J: a multiple of JournalAlign; 0 for length-preserving modes
	Sectors       uint64 // N: data sectors exposed
}

// Authenticated reports whether sectors carry metadata records (and so need the journal).
func (l Layout) Authenticated() bool { return l.MetaSize > 0 }

// MetaBlockSize is M, the length of one metadata block (0 without metadata).
func (l Layout) MetaBlockSize() int {
	if !l.Authenticated() {
		return 0
	}
	return max(l.SectorSize, 4096)
}

// RecordsPerGroup is R, the number of data sectors a metadata block describes.
func (l Layout) RecordsPerGroup() int {
	if !l.Authenticated() {
		return 0
	}
	return l.MetaBlockSize() / l.MetaSize
}

// GroupLen is G, the length of one full group (metadata block and its data sectors).
func (l Layout) GroupLen() int64 {
	return int64(l.MetaBlockSize()) + int64(l.RecordsPerGroup())*int64(l.SectorSize)
}

// Groups is the number of groups, the last one possibly partial.
func (l Layout) Groups() uint64 {
	r := uint64(l.RecordsPerGroup())
	if r == 0 {
		return 0
	}
	return (l.Sectors + r - 1) / r
}

// Span is the length of the data area. Callers validate the layout first: it does not
// check for overflow.
func (l Layout) Span() int64 {
	return spanOf(l.SectorSize, l.MetaSize, l.Sectors)
}

func spanOf(sectorSize, metaSize int, n uint64) int64 {
	s := int64(sectorSize)
	if metaSize == 0 {
		return int64(n) * s
	}
	m := int64(max(sectorSize, 4096))
	r := uint64(m) / uint64(metaSize)
	g := m + int64(r)*s
	span := int64(n/r) * g
	if rem := int64(n % r); rem > 0 {
		span += m + rem*s
	}
	return span
}

// Size is the exposed size in bytes, N·S.
func (l Layout) Size() int64 { return int64(l.Sectors) * int64(l.SectorSize) }

// dataPos is where sector i's data is stored.
func (l Layout) dataPos(i uint64) int64 {
	if !l.Authenticated() {
		return l.DataOffset + int64(i)*int64(l.SectorSize)
	}
	r := uint64(l.RecordsPerGroup())
	g, j := i/r, i%r
	return l.blockPos(g) + int64(l.MetaBlockSize()) + int64(j)*int64(l.SectorSize)
}

// blockPos is where group g's metadata block is stored.
func (l Layout) blockPos(g uint64) int64 { return l.DataOffset + int64(g)*l.GroupLen() }

// groupOf returns sector i's group and its position in it.
func (l Layout) groupOf(i uint64) (g uint64, j int) {
	r := uint64(l.RecordsPerGroup())
	return i / r, int(i % r)
}

// groupSectors is the number of data sectors in group g (R except perhaps for the last).
func (l Layout) groupSectors(g uint64) int {
	r := uint64(l.RecordsPerGroup())
	return int(min(r, l.Sectors-g*r))
}

// journalCap is the number of entries the journal holds (64 + 88·C + 16 ≤ J).
func (l Layout) journalCap() int {
	return int((l.JournalLen - journalHeaderLen - journalTagLen) / journalEntryLen)
}

// headerBOffset is T, where header copy B starts on a provider of the given size.
func headerBOffset(providerSize int64) int64 {
	return providerSize - providerSize%HeaderCopyLen - HeaderCopyLen
}

// dataLimit is E, where the data area must end by on a provider of the given size.
func dataLimit(providerSize int64) int64 {
	t := headerBOffset(providerSize)
	return t - t%JournalAlign
}

// Validate checks l against docs/format.md and a provider of providerSize bytes. Every
// field may come from a disk, so each is bounded before any arithmetic trusts it.
func (l Layout) Validate(providerSize int64) error {
	if !sector.ValidSectorSize(l.SectorSize) {
		return fmt.Errorf("layout: invalid sector size %d (need a power of two from %d to %d)",
			l.SectorSize, sector.MinSectorSize, sector.MaxSectorSize)
	}
	switch l.MetaSize {
	case 0:
		if l.JournalLen != 0 || l.JournalOffset != 0 {
			return fmt.Errorf("layout: length-preserving mode with a journal (offset %d, length %d)", l.JournalOffset, l.JournalLen)
		}
		if l.DataOffset != HeaderRegionLen {
			return fmt.Errorf("layout: data offset %d, want %d", l.DataOffset, HeaderRegionLen)
		}
	case RecordSize:
		if l.JournalOffset != HeaderRegionLen {
			return fmt.Errorf("layout: journal offset %d, want %d", l.JournalOffset, HeaderRegionLen)
		}
		if l.JournalLen < JournalAlign || l.JournalLen > MaxJournalLen || l.JournalLen%JournalAlign != 0 {
			return fmt.Errorf("layout: journal length %d is not a multiple of %d from %d to %d",
				l.JournalLen, JournalAlign, JournalAlign, MaxJournalLen)
		}
		if l.DataOffset != HeaderRegionLen+l.JournalLen {
			return fmt.Errorf("layout: data offset %d, want %d (after the journal)", l.DataOffset, HeaderRegionLen+l.JournalLen)
		}
	default:
		return fmt.Errorf("layout: metadata size %d per sector is not 0 or %d", l.MetaSize, RecordSize)
	}
	if l.Sectors == 0 {
		return fmt.Errorf("layout: no data sectors")
	}
	// A sector count whose span cannot be an int64 is refused before spanOf multiplies.
	if l.Sectors > uint64(math.MaxInt64)/uint64(l.SectorSize+l.MetaSize)/2 {
		return fmt.Errorf("layout: %d sectors of %d bytes cannot fit any provider", l.Sectors, l.SectorSize)
	}
	if providerSize < 0 || providerSize > math.MaxInt64/2 {
		return fmt.Errorf("layout: provider size %d out of range", providerSize)
	}
	end, limit := l.DataOffset+l.Span(), dataLimit(providerSize)
	if end > limit {
		return fmt.Errorf("layout: %d sectors need the data area to end at %d, but a %d-byte provider allows %d (provider shrunk?)",
			l.Sectors, end, providerSize, limit)
	}
	return nil
}

// PlanLayout returns the layout with the most sectors of sectorSize bytes that fits a
// provider of providerSize bytes in the given mode. journalLen is the journal's length
// for authenticated modes (0 takes DefaultJournalLen) and is ignored for
// length-preserving ones, which have no journal.
func PlanLayout(providerSize int64, sectorSize int, mode sector.Mode, journalLen int64) (Layout, error) {
	if !mode.Valid() {
		return Layout{}, fmt.Errorf("plan layout: invalid mode %d", uint8(mode))
	}
	if !sector.ValidSectorSize(sectorSize) {
		return Layout{}, fmt.Errorf("plan layout: invalid sector size %d (need a power of two from %d to %d)",
			sectorSize, sector.MinSectorSize, sector.MaxSectorSize)
	}
	l := Layout{SectorSize: sectorSize, MetaSize: mode.MetaSize(), DataOffset: HeaderRegionLen}
	if l.MetaSize > 0 {
		if journalLen == 0 {
			journalLen = DefaultJournalLen
		}
		if journalLen < JournalAlign || journalLen > MaxJournalLen || journalLen%JournalAlign != 0 {
			return Layout{}, fmt.Errorf("plan layout: journal length %d is not a multiple of %d from %d to %d",
				journalLen, JournalAlign, JournalAlign, MaxJournalLen)
		}
		l.JournalOffset, l.JournalLen = HeaderRegionLen, journalLen
		l.DataOffset += journalLen
	}
	minSize := MinProviderSize(l)
	if providerSize < minSize || providerSize > math.MaxInt64/2 {
		return Layout{}, fmt.Errorf("provider too small: %d bytes, need at least %d for %s with %d-byte sectors",
			providerSize, minSize, mode, sectorSize)
	}
	avail := dataLimit(providerSize) - l.DataOffset
	s := int64(sectorSize)
	if l.MetaSize == 0 {
		l.Sectors = uint64(avail / s)
	} else {
		m, r := int64(l.MetaBlockSize()), int64(l.RecordsPerGroup())
		full := avail / l.GroupLen()
		n := full * r
		if rem := avail - full*l.GroupLen(); rem > m {
			n += min(r, (rem-m)/s)
		}
		l.Sectors = uint64(n)
	}
	return l, l.Validate(providerSize)
}

// MinProviderSize is the smallest provider that holds l's journal and one data sector.
func MinProviderSize(l Layout) int64 {
	end := l.DataOffset + spanOf(l.SectorSize, l.MetaSize, 1)
	end = (end + JournalAlign - 1) / JournalAlign * JournalAlign
	return end + HeaderCopyLen
}

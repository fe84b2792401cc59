// Package layout is the geometry of an eli provider (docs/format.md, "Regions" and "Data
// area"): where the header copies, the journal, the metadata blocks and the data sectors
// lie. keys/ stores a Layout's fields in the header; blockdev/ does its I/O by it; the CLI
// plans one for init, resize and onetime. One definition, so that the header and the
// device can never disagree about where a sector is.
package layout

import (
	"errors"
	"fmt"
	"math"

	"github.com/elidisk/eli/sector"
)

// Fixed offsets and sizes of docs/format.md.
const (
	// HeaderCopyLen is the length of one header copy.
	HeaderCopyLen = 4096
	// HeaderRegionLen is header copy A plus the reserved area; the journal (or, without
	// one, the data area) starts right after it.
	HeaderRegionLen = 65536
	// HotzoneOffset and HotzoneLen place the hotzone of a length-preserving mode's
	// re-encryption in the reserved area after header copy A (and after a remote
	// provider's ownership block at 4096): two slots of HotzoneLen/2 bytes.
	HotzoneOffset = 8192
	HotzoneLen    = HeaderRegionLen - HotzoneOffset
	// Align is the unit of the journal's length and of the data area's start and end.
	Align = 65536
	// DefaultJournalLen holds about 23800 entries (a 93 MiB batch of 4 KiB sectors).
	DefaultJournalLen = 2 << 20
	// MaxJournalLen bounds the journal, which recovery reads whole into memory.
	MaxJournalLen = 64 << 20
	// RecordSize is the metadata record of an authenticated sector (nonce ‖ tag).
	RecordSize = 40
	// minMetaBlock is the smallest metadata block: records for sectors below 4 KiB are
	// packed into 4 KiB blocks so a group still covers about a hundred sectors.
	minMetaBlock = 4096
)

// Errors. Every error of this package wraps one of them.
var (
	// ErrInvalid: layout fields the format does not allow.
	ErrInvalid = errors.New("invalid volume layout")
	// ErrTooSmall: the provider cannot hold the layout.
	ErrTooSmall = errors.New("provider too small")
)

func invalid(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, a...))
}

// Format versions. Version 2 (authenticated modes only) keeps a hash tree over the
// metadata blocks, whose nodes are nested in the data area, and a journal of two slots
// that carries the tree's root (docs/format.md, "Format version 2").
const (
	Version1 = 1
	Version2 = 2
)

// The hash tree of format version 2.
const (
	// NodeSize is the length of a tree node: TreeArity digests of 32 bytes.
	NodeSize = 4096
	// TreeArity is the number of children of a tree node.
	TreeArity = 128
	// TreeDepth is the number of node levels placed in every version 2 data area: 128^7
	// groups exceed any volume Check accepts, so a volume that grows never needs a node
	// where a group already lies.
	TreeDepth = 7
)

// Layout places a volume's journal and data area on its provider.
type Layout struct {
	// Version is Version2 for format version 2, and 0 (the canonical form, so that a
	// Layout written without it keeps meaning what it always did) or Version1 for
	// version 1. FormatVersion says which.
	Version    uint32
	Mode       sector.Mode
	SectorSize int    // S: a power of two, 512 to 65536
	DataOffset int64  // D = HeaderRegionLen + JournalLen
	JournalLen int64  // J: a multiple of Align; > 0 for authenticated modes, 0 otherwise
	Sectors    uint64 // N: data sectors exposed
}

// FormatVersion is the format version, 0 read as Version1.
func (l Layout) FormatVersion() uint32 {
	if l.Version == 0 {
		return Version1
	}
	return l.Version
}

// Tree reports whether the volume keeps a hash tree over its metadata (format version 2).
func (l Layout) Tree() bool { return l.Version == Version2 }

// MetaSize is the metadata record length per sector: 0 for length-preserving modes.
func (l Layout) MetaSize() int { return l.Mode.MetaSize() }

// Authenticated reports whether sectors carry records (and so the volume has a journal).
func (l Layout) Authenticated() bool { return l.MetaSize() > 0 }

// JournalOffset is where the journal starts: HeaderRegionLen, or 0 without a journal.
func (l Layout) JournalOffset() int64 {
	if l.JournalLen == 0 {
		return 0
	}
	return HeaderRegionLen
}

// MetaBlockSize is M, the length of one metadata block (0 without metadata).
func (l Layout) MetaBlockSize() int {
	if !l.Authenticated() {
		return 0
	}
	return max(l.SectorSize, minMetaBlock)
}

// RecordsPerGroup is R, the number of data sectors one metadata block describes.
func (l Layout) RecordsPerGroup() int {
	if !l.Authenticated() {
		return 0
	}
	return l.MetaBlockSize() / l.MetaSize()
}

// GroupLen is G, the length of a full group (metadata block and its data sectors).
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

// Size is the exposed size in bytes, N·S.
func (l Layout) Size() int64 { return int64(l.Sectors) * int64(l.SectorSize) }

// Span is the length of the data area, span(N). Validate first: Span does not check
// for overflow.
func (l Layout) Span() int64 {
	span, _ := l.span()
	return span
}

// span is span(N) from docs/format.md, with ok false when it overflows an int64.
func (l Layout) span() (int64, bool) {
	s, n := uint64(l.SectorSize), l.Sectors
	if !l.Authenticated() {
		if s == 0 || n > math.MaxInt64/s {
			return 0, false
		}
		return int64(n * s), true
	}
	m, r := uint64(l.MetaBlockSize()), uint64(l.RecordsPerGroup())
	g := m + r*s
	if l.Tree() {
		if n == 0 {
			return 0, true
		}
		last := (n - 1) / r
		start := l.unitStart(0, last)
		span := addSat(start, m+(n-last*r)*s)
		if span > math.MaxInt64 {
			return 0, false
		}
		return int64(span), true
	}
	full, rest := n/r, n%r
	if full > math.MaxInt64/g {
		return 0, false
	}
	span := full * g
	if rest > 0 {
		tail := m + rest*s // < g: no overflow
		if span > math.MaxInt64-tail {
			return 0, false
		}
		span += tail
	}
	return int64(span), true
}

// End is D + span(N), where the data area ends.
func (l Layout) End() int64 { return l.DataOffset + l.Span() }

// DataPos is where sector i's data is stored.
func (l Layout) DataPos(i uint64) int64 {
	if !l.Authenticated() {
		return l.DataOffset + int64(i)*int64(l.SectorSize)
	}
	g, j := l.GroupOf(i)
	return l.BlockPos(g) + int64(l.MetaBlockSize()) + int64(j)*int64(l.SectorSize)
}

// BlockPos is where group g's metadata block is stored.
func (l Layout) BlockPos(g uint64) int64 {
	if l.Tree() {
		return l.DataOffset + int64(l.unitStart(0, g))
	}
	return l.DataOffset + int64(g)*l.GroupLen()
}

// NodePos is where tree node index of level (1 to TreeDepth) is stored (format version 2).
//
// The data area of a version 2 volume is one level-TreeDepth unit: a unit of level L ≥ 1 is
// its level-L node followed by up to TreeArity units of level L−1, and a unit of level 0 is a
// group. So a level-1 node precedes every 128 groups, a level-2 node every 128 of those, and
// positions follow from the indexes alone, whatever the volume's size.
func (l Layout) NodePos(level int, index uint64) int64 {
	if level < 1 || level > TreeDepth {
		panic("layout: tree level out of range")
	}
	return l.DataOffset + int64(l.unitStart(level, index))
}

// unitLen is the length of a full unit of level (saturating at MaxUint64).
func (l Layout) unitLen(level int) uint64 {
	u := uint64(l.GroupLen())
	for range level {
		u = addSat(NodeSize, mulSat(TreeArity, u))
	}
	return u
}

// unitStart is the offset in the data area of unit index of level (saturating).
func (l Layout) unitStart(level int, index uint64) uint64 {
	var off uint64
	u := l.unitLen(level)
	for m := level; m < TreeDepth; m++ {
		k := index % TreeArity
		if k != 0 {
			off = addSat(off, mulSat(k, u))
		}
		off = addSat(off, NodeSize)
		index /= TreeArity
		u = addSat(NodeSize, mulSat(TreeArity, u))
	}
	return off
}

func addSat(a, b uint64) uint64 {
	if a > math.MaxUint64-b {
		return math.MaxUint64
	}
	return a + b
}

func mulSat(a, b uint64) uint64 {
	if a != 0 && b > math.MaxUint64/a {
		return math.MaxUint64
	}
	return a * b
}

// JournalSlots is the number of journal slots: two in format version 2, written
// alternately, one otherwise.
func (l Layout) JournalSlots() int {
	if l.Tree() {
		return 2
	}
	return 1
}

// JournalSlotLen is the length of one journal slot.
func (l Layout) JournalSlotLen() int64 { return l.JournalLen / int64(l.JournalSlots()) }

// JournalSlotOffset is where journal slot k (0 or 1) starts.
func (l Layout) JournalSlotOffset(k int) int64 {
	return l.JournalOffset() + int64(k)*l.JournalSlotLen()
}

// RecordPos is where sector i's metadata record is stored.
func (l Layout) RecordPos(i uint64) int64 {
	g, j := l.GroupOf(i)
	return l.BlockPos(g) + int64(j)*int64(l.MetaSize())
}

// GroupOf returns sector i's group and its position in it.
func (l Layout) GroupOf(i uint64) (g uint64, j int) {
	r := uint64(l.RecordsPerGroup())
	return i / r, int(i % r)
}

// GroupSectors is the number of data sectors in group g (R, except perhaps for the last).
func (l Layout) GroupSectors(g uint64) int {
	r := uint64(l.RecordsPerGroup())
	return int(min(r, l.Sectors-g*r))
}

// HeaderBOffset is T, where header copy B starts on a provider of size bytes (always
// computed from the provider's current size), or -1 if the provider is too small to hold
// a copy B that does not overlap copy A.
func HeaderBOffset(size int64) int64 {
	t := size - size%HeaderCopyLen - HeaderCopyLen
	if t < HeaderCopyLen {
		return -1
	}
	return t
}

// DataLimit is E, the offset the data area must end at or before on a provider of size
// bytes, so that it never shares a 64 KiB unit with header copy B; -1 if there is no room.
func DataLimit(size int64) int64 {
	t := HeaderBOffset(size)
	if t < 0 {
		return -1
	}
	return t - t%Align
}

// Check validates the layout on its own, as read from a header: every field is bounded
// before any arithmetic trusts it. Errors wrap ErrInvalid.
func (l Layout) Check() error {
	if !l.Mode.Valid() {
		return invalid("mode %d is not a known cipher mode", uint8(l.Mode))
	}
	switch l.Version {
	case 0, Version1:
	case Version2:
		if !l.Mode.Authenticated() {
			return invalid("format version 2 is for authenticated modes; %s is length-preserving", l.Mode)
		}
	default:
		return invalid("format version %d is not 1 or 2", l.Version)
	}
	if !sector.ValidSectorSize(l.SectorSize) {
		return invalid("sector size %d is not a power of two from %d to %d",
			l.SectorSize, sector.MinSectorSize, sector.MaxSectorSize)
	}
	j := l.JournalLen
	switch {
	case l.Authenticated() && (j < Align || j > MaxJournalLen || j%Align != 0):
		return invalid("%s needs a journal of a multiple of %d bytes from %d to %d; the length is %d",
			l.Mode, Align, Align, MaxJournalLen, j)
	case !l.Authenticated() && j != 0:
		return invalid("%s has no journal, but the journal length is %d", l.Mode, j)
	}
	if want := HeaderRegionLen + j; l.DataOffset != want {
		return invalid("data offset %d, want %d (the header region, then the journal)", l.DataOffset, want)
	}
	if l.Sectors == 0 {
		return invalid("sector count is 0: a volume holds at least one sector")
	}
	if span, ok := l.span(); !ok || span > math.MaxInt64/2-l.DataOffset {
		return invalid("%d sectors of %d bytes overflow a 64-bit offset", l.Sectors, l.SectorSize)
	}
	return nil
}

// Validate checks the layout on its own and against a provider of size bytes. Errors wrap
// ErrInvalid or ErrTooSmall.
func (l Layout) Validate(size int64) error {
	if err := l.Check(); err != nil {
		return err
	}
	if limit := DataLimit(size); l.End() > limit {
		return fmt.Errorf("%w: %d sectors of %d bytes (%s) need the data area to end at %d, but a provider of %d bytes leaves room up to %d (did it shrink?)",
			ErrTooSmall, l.Sectors, l.SectorSize, l.Mode, l.End(), size, max(limit, 0))
	}
	return nil
}

// Plan returns the layout with the most sectors of sectorSize bytes that fits a provider
// of size bytes in mode. journalLen is the journal's length for authenticated modes (0:
// DefaultJournalLen) and must be 0 for length-preserving ones.
func Plan(size int64, sectorSize int, mode sector.Mode, journalLen int64) (Layout, error) {
	return PlanVersion(Version1, size, sectorSize, mode, journalLen)
}

// DefaultVersion is the format version eli init makes for mode: 2 (the hash tree) for the
// authenticated modes, 1 for the length-preserving ones.
func DefaultVersion(mode sector.Mode) uint32 {
	if mode.Authenticated() {
		return Version2
	}
	return Version1
}

// PlanVersion is Plan for a format version (Version2 for authenticated modes only).
func PlanVersion(version uint32, size int64, sectorSize int, mode sector.Mode, journalLen int64) (Layout, error) {
	if version == Version1 {
		version = 0
	}
	l := Layout{Version: version, Mode: mode, SectorSize: sectorSize, Sectors: 1}
	if mode.Valid() && mode.Authenticated() {
		if journalLen == 0 {
			journalLen = DefaultJournalLen
		}
		l.JournalLen = journalLen
	} else if journalLen != 0 {
		return Layout{}, invalid("%s has no journal: a journal length makes no sense", mode)
	}
	l.DataOffset = HeaderRegionLen + l.JournalLen
	if err := l.Check(); err != nil {
		return Layout{}, err
	}
	if min := MinProviderSize(l); size < min || size > math.MaxInt64/2 {
		return Layout{}, fmt.Errorf("%w: %d bytes, need at least %d for %s with %d-byte sectors",
			ErrTooSmall, size, min, mode, sectorSize)
	}
	avail, s := DataLimit(size)-l.DataOffset, int64(sectorSize)
	if !l.Authenticated() {
		l.Sectors = uint64(avail / s)
	} else {
		m, r := int64(l.MetaBlockSize()), int64(l.RecordsPerGroup())
		full := avail / l.GroupLen()
		n := full * r
		if rem := avail - full*l.GroupLen(); rem > m {
			n += min(r, (rem-m)/s)
		}
		l.Sectors = uint64(n)
		if l.Tree() {
			// Nodes take a little of the room: the most sectors that fit, by bisection
			// (the end grows with the sector count).
			limit := DataLimit(size)
			lo, hi := uint64(1), l.Sectors
			for lo < hi {
				mid := lo + (hi-lo+1)/2
				l.Sectors = mid
				if l.End() <= limit {
					lo = mid
				} else {
					hi = mid - 1
				}
			}
			l.Sectors = lo
		}
	}
	return l, l.Validate(size)
}

// MinProviderSize is the smallest provider that holds l: its header region, journal,
// data area and header copy B.
func (l Layout) MinProviderSize() int64 {
	end := (l.End() + Align - 1) / Align * Align
	return end + HeaderCopyLen
}

// MinProviderSize is the smallest provider that holds l's header region, journal, one
// data sector and header copy B: below it, init refuses.
func MinProviderSize(l Layout) int64 {
	l.Sectors = 1
	return l.MinProviderSize()
}

package keys

import "github.com/elidisk/eli/layout"

// Format constants from docs/format.md.
const (
	// HeaderSize is the length of one header copy and of a backup file.
	HeaderSize = layout.HeaderCopyLen
	// NumSlots is the number of keyslots in a header.
	NumSlots = 8
	// FormatVersion is format version 1, which every mode may use.
	FormatVersion = layout.Version1
	// FormatVersion2 is format version 2, authenticated modes with a hash tree over their
	// metadata (docs/format.md, "Format version 2"). The header is the same but for its
	// version field.
	FormatVersion2 = layout.Version2
)

// Layout is the part of the header that places the journal and the data area (package
// layout): the caller plans it with layout.Plan, Create stores it, Read returns it.
type Layout = layout.Layout

func knownVersion(v uint32) bool { return v == FormatVersion || v == FormatVersion2 }

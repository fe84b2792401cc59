package keys

import "github.com/elidisk/eli/layout"

// Format constants from docs/format.md.
const (
	// HeaderSize is the length of one header copy and of a backup file.
	HeaderSize = layout.HeaderCopyLen
	// NumSlots is the number of keyslots in a header.
	NumSlots = 8
	// FormatVersion is the header format version this package reads and writes.
	FormatVersion = 1
)

// Layout is the part of the header that places the journal and the data area (package
// layout): the caller plans it with layout.Plan, Create stores it, Read returns it.
type Layout = layout.Layout

package blockdev

import "github.com/elidisk/eli/layout"

// Layout is the geometry of the volume (package layout): the header, the device and the
// CLI share one definition.
type Layout = layout.Layout

// journalCap is the number of entries the journal holds (64 + 88·C + 16 ≤ J).
func journalCap(l Layout) int {
	return int((l.JournalLen - journalHeaderLen - journalTagLen) / journalEntryLen)
}

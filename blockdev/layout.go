package blockdev

import "github.com/elidisk/eli/layout"

// Layout is the geometry of the volume (package layout): the header, the device and the
// CLI share one definition.
type Layout = layout.Layout

// journalCap is the number of entries the journal holds (64 + 88·C + 16 ≤ J; in format
// version 2, 80 + 88·C + 16 ≤ J/2).
func journalCap(l Layout) int {
	if l.Tree() {
		return int((l.JournalSlotLen() - journal2HeaderLen - journalTagLen) / journalEntryLen)
	}
	return int((l.JournalLen - journalHeaderLen - journalTagLen) / journalEntryLen)
}

package keys

import (
	"encoding/hex"
	"fmt"
	"strings"
)

// Dump renders every header field for people (eli dump): layout, sequence, volume ID,
// each keyslot's state, credentials, KDF parameters and salt, and the MAC. Nothing in it
// is secret; the wrapped master keys are left out as noise.
func (h *Header) Dump() string {
	var b strings.Builder
	line := func(name, format string, a ...any) {
		fmt.Fprintf(&b, "%-15s %s\n", name+":", fmt.Sprintf(format, a...))
	}
	line("magic", "%q", magic[:])
	line("version", "%d", h.Version)
	switch h.Copy {
	case CopyNone:
		line("copy", "backup")
	default:
		line("copy", "%s (offset %d)", h.Copy, h.Offset)
	}
	line("sequence", "%d", h.Sequence)
	line("volume id", "%s", hex.EncodeToString(h.VolumeID[:]))
	line("mode", "%s", h.Mode)
	line("sector size", "%d", h.SectorSize)
	line("sectors", "%d (%d bytes)", h.Sectors, h.Sectors*uint64(h.SectorSize))
	line("data offset", "%d", h.DataOffset)
	line("journal offset", "%d", h.JournalOffset())
	line("journal length", "%d", h.JournalLen)
	line("provider size", "%d", h.ProviderSize)
	line("keyslots", "%d active of %d", h.ActiveSlots(), NumSlots)
	line("header mac", "%s", hex.EncodeToString(h.raw[offMAC:offMAC+macSize]))
	r := h.Reencryption()
	line("key epoch", "%d", r.Epoch)
	if r.Active {
		line("re-encryption", "under way from %s (epoch %d) to %s; checkpoint at sector %d of %d; the header holds the previous master key until it ends",
			r.PrevMode, r.Epoch-1, h.Mode, r.Cursor, h.Sectors)
	} else {
		line("re-encryption", "none (no previous master key in the header)")
	}
	for i, s := range h.Slots {
		if !s.Active {
			line(fmt.Sprintf("slot %d", i), "empty")
			continue
		}
		line(fmt.Sprintf("slot %d", i), "active, %s, %s, salt %s", s.Uses, s.KDF, hex.EncodeToString(s.Salt[:]))
	}
	if h.Warning != nil {
		line("warning", "%v", h.Warning)
	}
	return b.String()
}

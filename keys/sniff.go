package keys

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/elidisk/eli/internal/signature"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
)

// sniff describes what a provider without an eli header holds instead, from its first
// bytes (already read) and the signatures package signature knows.
func sniff(p provider.Provider, first []byte) string {
	if len(first) == 0 {
		return fmt.Sprintf("the provider is only %d bytes", p.Size())
	}
	if allZero(first) {
		return "the first 4096 bytes are zero: an empty provider?"
	}
	s := "first bytes look like " + hexPreview(first[:min(16, len(first))])
	if what, err := signature.Detect(p, p.Size()); err == nil && what != "" {
		s += ": " + what
	}
	return s
}

func hexPreview(b []byte) string {
	var sb strings.Builder
	for i, c := range b {
		if i > 0 {
			sb.WriteByte(' ')
		}
		fmt.Fprintf(&sb, "%02x", c)
	}
	sb.WriteString(" |")
	for _, c := range b {
		if c >= 0x20 && c < 0x7f {
			sb.WriteByte(c)
		} else {
			sb.WriteByte('.')
		}
	}
	sb.WriteByte('|')
	return sb.String()
}

// Remnant looks for what is left of a damaged eli header on a provider where Read found
// no copy with the eli magic: a copy's place (offset 0 or the end) whose fields after the
// magic still say format version 1 or 2, header length 4096 and 8 keyslots, 12 bytes that
// chance matches with probability about 2^-95. It returns where and what it found, or "" if
// nothing looks like eli. Its error is an I/O error.
func Remnant(p provider.Provider) (string, error) {
	size := p.Size()
	if size < HeaderSize {
		return "", nil
	}
	le := binary.LittleEndian
	for _, off := range []int64{0, layout.HeaderBOffset(size)} {
		if off < 0 || off+HeaderSize > size {
			continue
		}
		b := make([]byte, HeaderSize)
		if err := readAt(p, b, off); err != nil {
			return "", err
		}
		if knownVersion(le.Uint32(b[offVersion:])) && le.Uint32(b[offLength:]) == HeaderSize && le.Uint32(b[offSlotCount:]) == NumSlots {
			return fmt.Sprintf("a damaged eli header copy at offset %d: its magic is gone, its other fields are an eli header's", off), nil
		}
	}
	return "", nil
}

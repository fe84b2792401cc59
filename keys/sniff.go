package keys

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
)

// sniff describes what a provider without an eli header holds instead, from its first
// bytes (already read) and, for geli, its last sector. Signatures, from each format's
// documentation: LUKS "LUKS\xba\xbe" at 0; ext2/3/4 superblock magic 0xEF53 at 1024+56;
// XFS "XFSB" at 0; Linux swap "SWAPSPACE2" at 4086 (4 KiB pages); GPT "EFI PART" at 512;
// MBR 0x55AA at 510; geli metadata "GEOM::ELI" at the start of the provider's last sector.
func sniff(p provider.Provider, first []byte) string {
	if len(first) == 0 {
		return fmt.Sprintf("the provider is only %d bytes", p.Size())
	}
	var what string
	switch {
	case allZero(first):
		return "the first 4096 bytes are zero: an empty provider?"
	case bytes.HasPrefix(first, []byte("LUKS\xba\xbe")):
		what = "a LUKS header"
	case len(first) >= 1082 && binary.LittleEndian.Uint16(first[1080:]) == 0xEF53:
		what = "an ext2/3/4 filesystem"
	case bytes.HasPrefix(first, []byte("XFSB")):
		what = "an XFS filesystem"
	case len(first) >= 4096 && bytes.Equal(first[4086:4096], []byte("SWAPSPACE2")):
		what = "Linux swap space"
	case len(first) >= 520 && bytes.Equal(first[512:520], []byte("EFI PART")):
		what = "a GPT partition table"
	case len(first) >= 512 && first[510] == 0x55 && first[511] == 0xAA:
		what = "an MBR partition table or boot sector"
	}
	if what == "" {
		for _, secSize := range []int64{512, 4096} {
			if p.Size() >= secSize {
				last := make([]byte, 9)
				if readAt(p, last, p.Size()-secSize) == nil && string(last) == "GEOM::ELI" {
					what = "FreeBSD geli metadata (in the last sector)"
					break
				}
			}
		}
	}
	s := "first bytes look like " + hexPreview(first[:min(16, len(first))])
	if what != "" {
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

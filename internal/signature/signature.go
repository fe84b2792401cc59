// Package signature recognizes what a provider holds besides an eli volume, from the
// signatures that filesystems, encryption layers, volume managers and partition tables
// put at fixed places: the ones libblkid (util-linux) and file(1) look for first. It
// reads a few blocks, never more than 68 KiB and the last 4 KiB of the provider.
//
// Where each one is, from each format's own documentation:
//
//   - LUKS1 and LUKS2: "LUKS\xba\xbe" at 0, the version a big-endian u16 at 6 (LUKS On-Disk
//     Format Specification 1.2.3, "phdr"); LUKS2's secondary header "SKUL\xba\xbe" at
//     16 KiB, or at a power of two up to 4 MiB when the primary's area is larger (LUKS2
//     On-Disk Format Specification, "Binary header").
//   - ext2/3/4: the superblock at 1024, s_magic 0xEF53 (little-endian) at its offset
//     0x38, s_feature_compat at 0x5C (0x4: a journal, ext3) and s_feature_incompat at
//     0x60 (0x40 extents, 0x80 64bit, 0x200 flex_bg: ext4) (Linux kernel documentation,
//     "ext4 Data Structures and Algorithms", "Super Block").
//   - XFS: sb_magicnum "XFSB" at 0 (XFS Algorithms & Data Structures, "Superblocks").
//   - btrfs: the primary superblock at 64 KiB (btrfs-select-super(8)), its magic
//     "_BHRfS_M" at offset 0x40 within it (btrfs documentation, "On-disk format").
//   - LVM2 physical volume: the label "LABELONE" at the start of one of the first four
//     512-byte sectors, with "LVM2 001" 24 bytes further (lvm2's label format, as
//     pvck(8) shows it).
//   - Linux swap: "SWAPSPACE2" (or the old "SWAP-SPACE") in the last 10 bytes of the first
//     page, for pages of 4, 8, 16 or 64 KiB (mkswap(8); linux/swap.h, union swap_header).
//   - GPT: "EFI PART" at LBA 1, that is 512 or 4096 (UEFI Specification, "GPT Header").
//   - NTFS: "NTFS    " at 3; FAT12/16 "FAT1x   " at 54 and FAT32 "FAT32   " at 82 of a
//     boot sector ending in 0x55AA (Microsoft FAT specification, "BPB"); ISO 9660
//     "CD001" at 32769 (ECMA-119, the primary volume descriptor at sector 16).
//   - FreeBSD geli: "GEOM::ELI" at the start of the provider's last sector, 512 or 4096
//     bytes (geli(8): "metadata is stored in the last sector").
//   - MBR: 0x55AA at 510 (a partition table or another boot sector).
package signature

import (
	"encoding/binary"
	"errors"
	"io"
)

// Detect names what the first bytes of r (size bytes long) show, such as "an ext4
// filesystem" or "a LUKS2 header", or returns "" if it knows none of them. Its error is
// an I/O error.
func Detect(r io.ReaderAt, size int64) (string, error) {
	head := make([]byte, min(size, 68<<10))
	if err := readAt(r, head, 0); err != nil {
		return "", err
	}
	at := func(off int, want string) bool {
		return off+len(want) <= len(head) && string(head[off:off+len(want)]) == want
	}
	u16 := func(off int, be bool) uint16 {
		if off+2 > len(head) {
			return 0
		}
		if be {
			return binary.BigEndian.Uint16(head[off:])
		}
		return binary.LittleEndian.Uint16(head[off:])
	}
	u32 := func(off int) uint32 {
		if off+4 > len(head) {
			return 0
		}
		return binary.LittleEndian.Uint32(head[off:])
	}
	switch {
	case at(0, "LUKS\xba\xbe"):
		if v := u16(6, true); v == 1 || v == 2 {
			return []string{"", "a LUKS1 header", "a LUKS2 header"}[v], nil
		}
		return "a LUKS header", nil
	case u16(1024+0x38, false) == 0xEF53:
		compat, incompat := u32(1024+0x5C), u32(1024+0x60)
		switch {
		case incompat&(0x40|0x80|0x200) != 0:
			return "an ext4 filesystem", nil
		case compat&0x4 != 0:
			return "an ext3 filesystem", nil
		}
		return "an ext2 filesystem", nil
	case at(0, "XFSB"):
		return "an XFS filesystem", nil
	case at(65536+0x40, "_BHRfS_M"):
		return "a btrfs filesystem", nil
	}
	for s := 0; s < 4; s++ {
		if at(s*512, "LABELONE") && at(s*512+24, "LVM2 001") {
			return "an LVM2 physical volume", nil
		}
	}
	for _, page := range []int{4096, 8192, 16384, 65536} {
		if at(page-10, "SWAPSPACE2") || at(page-10, "SWAP-SPACE") {
			return "Linux swap space", nil
		}
	}
	for off := 16 << 10; off <= 4<<20; off *= 2 {
		if int64(off)+6 > size {
			break
		}
		b := make([]byte, 6)
		if err := readAt(r, b, int64(off)); err != nil {
			return "", err
		}
		if string(b) == "SKUL\xba\xbe" {
			return "a LUKS2 header (its secondary copy)", nil
		}
	}
	switch {
	case at(512, "EFI PART") || at(4096, "EFI PART"):
		return "a GPT partition table", nil
	case at(3, "NTFS    "):
		return "an NTFS filesystem", nil
	case (at(54, "FAT12   ") || at(54, "FAT16   ") || at(82, "FAT32   ")) && at(510, "\x55\xaa"):
		return "a FAT filesystem", nil
	case at(32769, "CD001"):
		return "an ISO 9660 filesystem", nil
	}
	for _, sec := range []int64{512, 4096} {
		if size < sec {
			continue
		}
		b := make([]byte, 9)
		if err := readAt(r, b, size-sec); err != nil {
			return "", err
		}
		if string(b) == "GEOM::ELI" {
			return "FreeBSD geli metadata (in the last sector)", nil
		}
	}
	if at(510, "\x55\xaa") {
		return "an MBR partition table or boot sector", nil
	}
	return "", nil
}

// readAt reads exactly len(b) bytes at off; io.EOF at the very end is no error.
func readAt(r io.ReaderAt, b []byte, off int64) error {
	n, err := r.ReadAt(b, off)
	if n == len(b) && (err == nil || errors.Is(err, io.EOF)) {
		return nil
	}
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	return err
}

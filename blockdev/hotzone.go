package blockdev

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"

	"github.com/elidisk/eli/layout"
)

// The hotzone of a length-preserving mode's re-encryption (docs/format.md,
// "Re-encryption", "Hotzone"): two slots in the reserved area after header copy A,
// written alternately like version 2's journal slots. The newest valid slot of the
// volume's key epoch says where the sweep stands: sectors below lo are under the
// current key, sectors from hi under the previous one, and sector lo+k of the window is
// under the previous key exactly when the truncated SHA-256 of its ciphertext is the
// slot's k-th checksum (a zero checksum: already under the current key). A slot is
// durable before the window it describes is rewritten, so a crash leaves each sector of
// the window with its old ciphertext (which matches) or its new one (which does not),
// provided the provider writes a sector atomically. A torn slot fails its checksum, and
// the other slot, whose window was rewritten and synced, holds.
const (
	hotzoneMagic     = "ELIHOTZ1"
	hotzoneHeaderLen = 48
	hotzoneSumLen    = 16 // checksum of one sector
	hotzoneSlotLen   = layout.HotzoneLen / 2
	// hotzoneCap is the most sectors a window holds.
	hotzoneCap = (hotzoneSlotLen - hotzoneHeaderLen - sha256.Size) / hotzoneSumLen
)

// hotzoneSlot is one slot's contents.
type hotzoneSlot struct {
	seq, epoch, lo, hi uint64
	sums               []byte // hotzoneSumLen per sector of [lo, hi)
}

// hotzoneSumBytes is how much of a sector its checksum covers. Under the atomic-sector
// assumption a sector holds all of its old ciphertext or all of its new one, and the two
// differ in their first block but with negligible probability (two keys, or a key and
// plaintext), so the first 64 bytes tell them apart as well as the whole sector would,
// at a small part of the cost of hashing it (BenchmarkReencrypt).
const hotzoneSumBytes = 64

// sectorSum is the checksum a slot keeps of a sector's old ciphertext: the first 16
// bytes of SHA-256 of its first hotzoneSumBytes.
func sectorSum(ct []byte) (s [hotzoneSumLen]byte) {
	h := sha256.Sum256(ct[:hotzoneSumBytes])
	copy(s[:], h[:])
	return s
}

// matches reports whether ct is the old ciphertext of window sector k.
func (z *hotzoneSlot) matches(k int, ct []byte) bool {
	want := z.sums[k*hotzoneSumLen : (k+1)*hotzoneSumLen]
	if bytes.Equal(want, zeroes(hotzoneSumLen)) {
		return false
	}
	s := sectorSum(ct)
	return bytes.Equal(s[:], want)
}

// encodeHotzone lays z out as a slot, and returns its bytes and offset.
func encodeHotzone(z *hotzoneSlot, buf []byte) ([]byte, int64) {
	n := hotzoneHeaderLen + len(z.sums) + sha256.Size
	if cap(buf) < n {
		buf = make([]byte, n)
	}
	b := buf[:n]
	clear(b[:hotzoneHeaderLen])
	copy(b, hotzoneMagic)
	le := binary.LittleEndian
	le.PutUint64(b[8:], z.seq)
	le.PutUint64(b[16:], z.epoch)
	le.PutUint64(b[24:], z.lo)
	le.PutUint64(b[32:], z.hi)
	copy(b[hotzoneHeaderLen:], z.sums)
	sum := sha256.Sum256(b[:n-sha256.Size])
	copy(b[n-sha256.Size:], sum[:])
	return b, hotzoneSlotOffset(int(z.seq % 2))
}

func hotzoneSlotOffset(k int) int64 { return layout.HotzoneOffset + int64(k)*hotzoneSlotLen }

// readHotzone returns the newest valid slot of epoch (nil if none). A slot that has the
// magic and its checksum but breaks the rules was written by someone else than eli, and
// refuses the attach.
func readHotzone(r io.ReaderAt, epoch, sectors uint64) (*hotzoneSlot, error) {
	buf := make([]byte, hotzoneSlotLen)
	var best *hotzoneSlot
	for k := range 2 {
		if _, err := r.ReadAt(buf, hotzoneSlotOffset(k)); err != nil {
			return nil, fmt.Errorf("read hotzone slot %d: %w", k, err)
		}
		if string(buf[:8]) != hotzoneMagic {
			continue
		}
		le := binary.LittleEndian
		z := hotzoneSlot{seq: le.Uint64(buf[8:]), epoch: le.Uint64(buf[16:]), lo: le.Uint64(buf[24:]), hi: le.Uint64(buf[32:])}
		if z.hi < z.lo || z.hi-z.lo > hotzoneCap {
			continue // torn: the count is not to be trusted
		}
		n := hotzoneHeaderLen + int(z.hi-z.lo)*hotzoneSumLen
		if sum := sha256.Sum256(buf[:n]); !bytes.Equal(sum[:], buf[n:n+sha256.Size]) {
			continue // torn
		}
		if z.epoch != epoch {
			continue // of an earlier re-encryption
		}
		switch {
		case z.seq == 0 || z.seq%2 != uint64(k):
			return nil, fmt.Errorf("hotzone slot %d holds sequence %d, which belongs in slot %d", k, z.seq, z.seq%2)
		case z.hi > sectors || !bytes.Equal(buf[40:hotzoneHeaderLen], zeroes(hotzoneHeaderLen-40)):
			return nil, fmt.Errorf("hotzone slot %d (window %d-%d) does not fit the volume's %d sectors, or its reserved bytes are not zero", k, z.lo, z.hi, sectors)
		}
		z.sums = bytes.Clone(buf[hotzoneHeaderLen:n])
		if best == nil || z.seq > best.seq {
			best = &z
		}
	}
	return best, nil
}

package aesxts

import (
	"bytes"
	"testing"
)

// FuzzAgainstXCrypto feeds keys, unit numbers, unit sizes, run lengths, alignments and
// data to every engine and compares with golang.org/x/crypto/xts unit by unit: Encrypt
// and Decrypt of the whole input as one unit, and EncryptSectors and DecryptSectors of it
// as a run of units, out of place and in place.
func FuzzAgainstXCrypto(f *testing.F) {
	f.Add(make([]byte, 32), uint64(0), uint8(0), uint8(0), false, make([]byte, 16))
	f.Add(bytes.Repeat([]byte{0x5a, 0xa5}, 32), uint64(1<<64-1), uint8(31), uint8(5), true, make([]byte, 512*3))
	f.Add(seq(3, 64), uint64(1<<32-1), uint8(15), uint8(63), false, seq(9, 4096+256+48))
	f.Add(seq(7, 32), uint64(0x3333333333), uint8(2), uint8(17), true, seq(1, 48*7))
	f.Fuzz(func(t *testing.T, keyIn []byte, index uint64, unitSel, offset uint8, long bool, data []byte) {
		key := make([]byte, 32)
		if long {
			key = make([]byte, 64)
		}
		copy(key, keyIn)
		data = data[:len(data)&^15]
		if len(data) == 0 {
			return
		}
		ref := refCipher(t, key)
		// The unit: the largest multiple of 16 up to 16·(unitSel+1) that divides the input.
		blocks := len(data) / 16
		unit := 16
		for u := int(unitSel)%64 + 1; u >= 1; u-- {
			if blocks%u == 0 {
				unit = 16 * u
				break
			}
		}
		whole := make([]byte, len(data))
		ref.Encrypt(whole, data, index)
		run := make([]byte, len(data))
		for k := 0; k < len(data); k += unit {
			ref.Encrypt(run[k:k+unit], data[k:k+unit], index+uint64(k/unit))
		}
		off := int(offset % 64)
		for _, e := range engines() {
			c := mustCipher(t, key, e)
			src := make([]byte, off+len(data))
			copy(src[off:], data)
			got := make([]byte, len(data)+64)
			out := got[63-off : 63-off+len(data)]

			c.Encrypt(out, src[off:], index)
			if !bytes.Equal(out, whole) {
				t.Fatalf("%v Encrypt of %d bytes: first difference at %d", e, len(data), firstDiff(out, whole))
			}
			c.Decrypt(out, out, index)
			if !bytes.Equal(out, data) {
				t.Fatalf("%v Decrypt in place of %d bytes: first difference at %d", e, len(data), firstDiff(out, data))
			}
			c.EncryptSectors(src[off:], src[off:], unit, index)
			if !bytes.Equal(src[off:], run) {
				t.Fatalf("%v EncryptSectors in place, %d-byte units: first difference at %d", e, unit, firstDiff(src[off:], run))
			}
			c.DecryptSectors(out, src[off:], unit, index)
			if !bytes.Equal(out, data) {
				t.Fatalf("%v DecryptSectors, %d-byte units: first difference at %d", e, unit, firstDiff(out, data))
			}
		}
	})
}

// seq returns n bytes counting up from start.
func seq(start byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = start + byte(i)
	}
	return b
}

package poly1305

import (
	"bytes"
	"testing"

	"golang.org/x/crypto/poly1305"
)

// FuzzSumAEAD compares every path with x/crypto over the explicit MAC input, for
// random keys, additional data, ciphertexts and alignments.
func FuzzSumAEAD(f *testing.F) {
	f.Add(make([]byte, 32), make([]byte, 42), make([]byte, 512), uint8(0))
	f.Add(bytes.Repeat([]byte{0xff}, 32), bytes.Repeat([]byte{0xff}, 13), bytes.Repeat([]byte{0xff}, 4096), uint8(3))
	f.Add(append([]byte{1}, make([]byte, 31)...), []byte{}, bytes.Repeat([]byte{0xfe}, 1000), uint8(17))
	f.Add(bytes.Repeat([]byte{0xa5}, 32), bytes.Repeat([]byte{0x5a}, 200), bytes.Repeat([]byte{0xff}, 2047), uint8(9))
	f.Fuzz(func(t *testing.T, keyBytes, ad, ct []byte, offset uint8) {
		var key [32]byte
		copy(key[:], keyBytes)
		off := int(offset % 64)
		moved := make([]byte, off+len(ct)) // the kernel reads unaligned input
		copy(moved[off:], ct)
		ct = moved[off:]
		var want [16]byte
		poly1305.Sum(&want, macInput(ad, ct), &key)
		for _, p := range paths() {
			var tag [16]byte
			sumAEAD(p, &tag, &key, ad, ct)
			if tag != want {
				t.Fatalf("%v: len(ad) %d, len(ct) %d: tag %x, x/crypto %x", p, len(ad), len(ct), tag, want)
			}
		}
	})
}

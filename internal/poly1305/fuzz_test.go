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

// FuzzSumAEADMany compares every path's SumAEADMany with x/crypto, message by message,
// for a message count, ad and ct length drawn from the input, keys and data expanded
// from seed bytes.
func FuzzSumAEADMany(f *testing.F) {
	f.Add(uint8(16), uint8(42), uint16(4096), []byte{1, 2, 3})
	f.Add(uint8(8), uint8(0), uint16(16), []byte{0xff})
	f.Add(uint8(24), uint8(64), uint16(512), bytes.Repeat([]byte{0xff}, 64))
	f.Add(uint8(17), uint8(65), uint16(100), []byte{})
	f.Fuzz(func(t *testing.T, n, adLen uint8, ctLen uint16, seed []byte) {
		count, al, cl := int(n%41), int(adLen%80), int(ctLen%4200)
		fill := func(k int) []byte {
			b := make([]byte, k)
			for i := range b {
				b[i] = byte(i*131 + 7)
				if len(seed) > 0 {
					b[i] ^= seed[i%len(seed)]
				}
			}
			return b
		}
		checkManyPaths(t, "fuzz", fill(32*count), fill(al*count), al, fill(cl*count), cl)
	})
}

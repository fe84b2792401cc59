package chacha

import (
	"bytes"
	"testing"
)

// FuzzSIMDvsGeneric feeds random keys, nonces, counters, round counts, layouts,
// alignments and lengths to every SIMD engine and compares with the generic code,
// out of place and in place.
func FuzzSIMDvsGeneric(f *testing.F) {
	f.Add(make([]byte, 32), make([]byte, 16), uint64(0), uint8(20), false, uint8(0), make([]byte, 64))
	f.Add(seq(1, 32), seq(7, 16), uint64(1<<32-3), uint8(8), true, uint8(5), make([]byte, 1100))
	f.Add(seq(9, 32), seq(3, 16), uint64(1<<32-40), uint8(12), false, uint8(63), bytes.Repeat([]byte{0xff}, 2600))
	f.Fuzz(func(t *testing.T, key, nonce []byte, counter uint64, roundsSel uint8, ctr64 bool, offset uint8, data []byte) {
		var st [16]uint32
		var k [KeySize]byte
		copy(k[:], key)
		initState(&st, &k)
		var n [16]byte
		copy(n[:], nonce)
		for i := 0; i < 4; i++ {
			st[12+i] = uint32(n[4*i]) | uint32(n[4*i+1])<<8 | uint32(n[4*i+2])<<16 | uint32(n[4*i+3])<<24
		}
		rounds := []int{8, 12, 20}[int(roundsSel)%3]
		st[12] = uint32(counter)
		if ctr64 {
			st[13] = uint32(counter >> 32)
		} else if blocks := uint64(len(data)+BlockSize-1) / BlockSize; uint64(st[12])+blocks > 1<<32 {
			st[12] = uint32(1<<32 - blocks) // a 32-bit counter never runs past its end
		}
		off := int(offset % 64)
		want := make([]byte, len(data))
		xorGeneric(&st, rounds, ctr64, want, data)
		for _, e := range engines()[1:] {
			src := make([]byte, off+len(data))
			copy(src[off:], data)
			got := make([]byte, len(data)+64)
			xorKeyStream(e, &st, rounds, ctr64, got[63-off:63-off+len(data)], src[off:])
			if !bytes.Equal(got[63-off:63-off+len(data)], want) {
				t.Fatalf("%v out of place: first difference at %d", e, firstDiff(got[63-off:], want))
			}
			xorKeyStream(e, &st, rounds, ctr64, src[off:], src[off:])
			if !bytes.Equal(src[off:], want) {
				t.Fatalf("%v in place: first difference at %d", e, firstDiff(src[off:], want))
			}
		}
	})
}

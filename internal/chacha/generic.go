package chacha

import (
	"crypto/subtle"
	"encoding/binary"
	"math/bits"
)

// The first four state words, "expand 32-byte k" (RFC 8439 §2.3).
const (
	sigma0 = 0x61707865
	sigma1 = 0x3320646e
	sigma2 = 0x79622d32
	sigma3 = 0x6b206574
)

func quarterRound(a, b, c, d uint32) (uint32, uint32, uint32, uint32) {
	a += b
	d = bits.RotateLeft32(d^a, 16)
	c += d
	b = bits.RotateLeft32(b^c, 12)
	a += b
	d = bits.RotateLeft32(d^a, 8)
	c += d
	b = bits.RotateLeft32(b^c, 7)
	return a, b, c, d
}

// permute applies rounds rounds (alternating column and diagonal rounds, RFC 8439
// §2.3) to x, without the final addition of the input.
func permute(x *[16]uint32, rounds int) {
	x0, x1, x2, x3 := x[0], x[1], x[2], x[3]
	x4, x5, x6, x7 := x[4], x[5], x[6], x[7]
	x8, x9, x10, x11 := x[8], x[9], x[10], x[11]
	x12, x13, x14, x15 := x[12], x[13], x[14], x[15]
	for i := 0; i < rounds; i += 2 {
		x0, x4, x8, x12 = quarterRound(x0, x4, x8, x12)
		x1, x5, x9, x13 = quarterRound(x1, x5, x9, x13)
		x2, x6, x10, x14 = quarterRound(x2, x6, x10, x14)
		x3, x7, x11, x15 = quarterRound(x3, x7, x11, x15)
		x0, x5, x10, x15 = quarterRound(x0, x5, x10, x15)
		x1, x6, x11, x12 = quarterRound(x1, x6, x11, x12)
		x2, x7, x8, x13 = quarterRound(x2, x7, x8, x13)
		x3, x4, x9, x14 = quarterRound(x3, x4, x9, x14)
	}
	*x = [16]uint32{x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15}
}

// hchachaGeneric permutes st (constants, key, 16-byte nonce) and returns words 0..3
// and 12..15: the HChaCha subkey.
func hchachaGeneric(st *[16]uint32, rounds int) [8]uint32 {
	x := *st
	permute(&x, rounds)
	return [8]uint32{x[0], x[1], x[2], x[3], x[12], x[13], x[14], x[15]}
}

// blockGeneric writes the keystream block of state st into out.
func blockGeneric(st *[16]uint32, rounds int, out *[BlockSize]byte) {
	x := *st
	permute(&x, rounds)
	for i, v := range x {
		binary.LittleEndian.PutUint32(out[4*i:], v+st[i])
	}
}

// xorGeneric XORs src into dst (len(dst) == len(src)) with keystream starting at the
// block counter in st. st itself is not changed.
func xorGeneric(st *[16]uint32, rounds int, ctr64 bool, dst, src []byte) {
	s := *st
	for len(src) >= BlockSize {
		x := s
		permute(&x, rounds)
		// Bounds hints: one check per block instead of one per word.
		d, in := dst[:BlockSize], src[:BlockSize]
		for i, v := range x {
			binary.LittleEndian.PutUint32(d[4*i:], binary.LittleEndian.Uint32(in[4*i:])^(v+s[i]))
		}
		advanceState(&s, 1, ctr64)
		dst, src = dst[BlockSize:], src[BlockSize:]
	}
	if len(src) > 0 {
		var ks [BlockSize]byte
		blockGeneric(&s, rounds, &ks)
		subtle.XORBytes(dst, src, ks[:len(src)])
		clear(ks[:])
	}
}

// advanceState adds n blocks to the counter in st: word 12 alone (RFC 8439 layout), or
// words 12 and 13 as one 64-bit counter.
func advanceState(st *[16]uint32, n uint64, ctr64 bool) {
	if !ctr64 {
		st[12] += uint32(n)
		return
	}
	c := uint64(st[12]) | uint64(st[13])<<32
	c += n
	st[12], st[13] = uint32(c), uint32(c>>32)
}

// hchachaManyGeneric is HChaCha for each 16-byte nonce in nonces, the key in st, one
// after another into out.
func hchachaManyGeneric(st *[16]uint32, rounds int, nonces, out []byte) {
	s := *st
	for len(nonces) >= HNonceSize {
		setHNonce(&s, nonces)
		sub := hchachaGeneric(&s, rounds)
		putSubkey(out, &sub)
		clear(sub[:])
		nonces, out = nonces[HNonceSize:], out[hSubkeySize:]
	}
	clear(s[4:12])
}

// setHNonce puts a 16-byte HChaCha nonce into words 12..15.
func setHNonce(st *[16]uint32, nonce []byte) {
	_ = nonce[HNonceSize-1]
	for i := 0; i < 4; i++ {
		st[12+i] = binary.LittleEndian.Uint32(nonce[4*i:])
	}
}

// putSubkey writes subkey words little-endian into out[:32].
func putSubkey(out []byte, sub *[8]uint32) {
	_ = out[hSubkeySize-1]
	for i, v := range sub {
		binary.LittleEndian.PutUint32(out[4*i:], v)
	}
}

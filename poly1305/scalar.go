//go:build amd64 && !purego

package poly1305

import (
	"encoding/binary"
	"math/bits"
)

// state is a Poly1305 computation in radix 2^64 (RFC 8439 §2.5): the accumulator h =
// h0 + h1·2^64 + h2·2^128, kept partly reduced (h2 ≤ 7 between blocks), and the
// clamped r = r0 + r1·2^64. All arithmetic is branch-free in the data.
type state struct {
	h0, h1, h2 uint64
	r0, r1     uint64
}

func (s *state) init(key *[32]byte) {
	// RFC 8439 §2.5.1's clamp: the top four bits of r[3], r[7], r[11], r[15] and the
	// bottom two of r[4], r[8], r[12] are cleared.
	s.r0 = binary.LittleEndian.Uint64(key[0:8]) & 0x0ffffffc0fffffff
	s.r1 = binary.LittleEndian.Uint64(key[8:16]) & 0x0ffffffc0ffffffc
}

// blocks runs h = (h + block + hibit·2^128)·r mod 2^130−5 over the 16-byte blocks of p
// (len(p) a multiple of 16). hibit is 1 for full blocks; 0 only for a raw message's
// final partial block, which the caller has padded with 0x01 and zeros.
func (s *state) blocks(p []byte, hibit uint64) {
	h0, h1, h2 := s.h0, s.h1, s.h2
	r0, r1 := s.r0, s.r1
	for ; len(p) >= 16; p = p[16:] {
		var c uint64
		h0, c = bits.Add64(h0, binary.LittleEndian.Uint64(p[0:8]), 0)
		h1, c = bits.Add64(h1, binary.LittleEndian.Uint64(p[8:16]), c)
		h2 += c + hibit

		// h·r with h2 ≤ 8 and r0, r1 < 2^60: h2·r0 and h2·r1 fit in 64 bits.
		m0hi, m0lo := bits.Mul64(h0, r0)
		ahi, alo := bits.Mul64(h1, r0)
		bhi, blo := bits.Mul64(h0, r1)
		chi, clo := bits.Mul64(h1, r1)
		m1lo, c := bits.Add64(alo, blo, 0)
		m1hi, _ := bits.Add64(ahi, bhi, c)
		m2lo, c := bits.Add64(clo, h2*r0, 0)
		m2hi := chi + c
		t0 := m0lo
		t1, c := bits.Add64(m0hi, m1lo, 0)
		t2, c := bits.Add64(m1hi, m2lo, c)
		t3 := m2hi + h2*r1 + c

		// t = low 130 bits + 2^130·high; 2^130 ≡ 5, so add 5·high = 4·high + high,
		// where 4·high is (t2 &^ 3, t3) as words.
		h0, h1, h2 = t0, t1, t2&3
		h0, c = bits.Add64(h0, t2&^3, 0)
		h1, c = bits.Add64(h1, t3, c)
		h2 += c
		h0, c = bits.Add64(h0, t2>>2|t3<<62, 0)
		h1, c = bits.Add64(h1, t3>>2, c)
		h2 += c
	}
	s.h0, s.h1, s.h2 = h0, h1, h2
}

// update absorbs p as whole 16-byte blocks, the last one zero-padded (the AEAD's
// padding), using the vector kernel for runs of eight blocks.
func (s *state) update(p []byte) {
	if n := len(p) &^ 127; n >= vectorMin {
		s.vector(p[:n])
		p = p[n:]
	}
	full := len(p) &^ 15
	s.blocks(p[:full], 1)
	if rest := p[full:]; len(rest) > 0 {
		var b [16]byte
		copy(b[:], rest)
		s.blocks(b[:], 1)
	}
}

// vectorMin is the shortest run worth the kernel's setup (three multiplications for
// the powers of r, each a dependency chain as long as a chunk's).
const vectorMin = 256

const mask44 = 1<<44 - 1

// vector runs the kernel over p (a positive multiple of 128 bytes), converting h to and
// from the kernel's radix 2^44.
func (s *state) vector(p []byte) {
	h := [3]uint64{
		s.h0 & mask44,
		(s.h0>>44 | s.h1<<20) & mask44,
		s.h1>>24 | s.h2<<40,
	}
	r := [3]uint64{
		s.r0 & mask44,
		(s.r0>>44 | s.r1<<20) & mask44,
		s.r1 >> 24,
	}
	blocksIFMA(&h, &r, &p[0], len(p))
	// h = h[0] + h[1]·2^44 + h[2]·2^88 with each limb below 2^48.
	var c uint64
	h0, c := bits.Add64(h[0], h[1]<<44, 0)
	h1, c := bits.Add64(h[1]>>20, h[2]<<24, c)
	h2 := h[2]>>40 + c
	// Fold the bits above 2^130 (2^130 ≡ 5) so that h2 ≤ 4 as blocks expects.
	top := h2 >> 2
	h2 &= 3
	h0, c = bits.Add64(h0, top*5, 0)
	h1, c = bits.Add64(h1, 0, c)
	s.h0, s.h1, s.h2 = h0, h1, h2+c
}

// finish writes (h mod 2^130−5) + s mod 2^128 to tag, s being key[16:32].
func (s *state) finish(tag *[16]byte, key *[32]byte) {
	h0, h1, h2 := s.h0, s.h1, s.h2
	// With h2 ≤ 7, folding its bits above 2^130 leaves h < 2^130 + 5.
	top := h2 >> 2
	h2 &= 3
	var c uint64
	h0, c = bits.Add64(h0, top*5, 0)
	h1, c = bits.Add64(h1, 0, c)
	h2 += c
	// h ≥ 2^130−5 exactly when h + 5 reaches 2^130; then h − p = (h + 5) − 2^130, whose
	// low 128 bits are g0, g1. Select by mask, not by branch.
	g0, c := bits.Add64(h0, 5, 0)
	g1, c := bits.Add64(h1, 0, c)
	g2 := h2 + c
	mask := -(g2 >> 2)
	h0 ^= (h0 ^ g0) & mask
	h1 ^= (h1 ^ g1) & mask

	h0, c = bits.Add64(h0, binary.LittleEndian.Uint64(key[16:24]), 0)
	h1, _ = bits.Add64(h1, binary.LittleEndian.Uint64(key[24:32]), c)
	binary.LittleEndian.PutUint64(tag[0:8], h0)
	binary.LittleEndian.PutUint64(tag[8:16], h1)
}

// sumIFMA is SumAEAD's vector path.
func sumIFMA(tag *[16]byte, key *[32]byte, ad, ct []byte) {
	var s state
	s.init(key)
	s.update(ad)
	s.update(ct)
	var lens [16]byte
	binary.LittleEndian.PutUint64(lens[0:8], uint64(len(ad)))
	binary.LittleEndian.PutUint64(lens[8:16], uint64(len(ct)))
	s.blocks(lens[:], 1)
	s.finish(tag, key)
}

//go:build amd64 && !purego

package poly1305

import (
	"encoding/binary"
	"math/bits"
)

// The vector path runs RFC 8439 §2.5's Horner rule, h = (h + block)·r mod 2^130−5 over
// the blocks of the MAC input, in the kernel, eight blocks (a 128-byte chunk) at a time.
// The MAC input is a stream of whole 16-byte blocks, each with its 2^128 bit:
//
//	ad || pad || ct || pad || lengths
//
// The kernel sees it as regular chunks and a tail chunk:
//
//   - ad goes first, behind z = −blocks(ad) mod 8 zero blocks so that it ends on a
//     chunk boundary. Leading zero blocks do not change a Horner sum that starts from
//     h = 0, except for the 2^128 bit the kernel adds to every block; the kernel starts
//     their lanes at −2^128 ≡ 3·2^128−5 (mod 2^130−5) to cancel it.
//   - ct's whole 128-byte chunks are read where they lie.
//   - The tail chunk holds the last t ≤ 8 blocks (the rest of ct and the lengths) in
//     its last t places; the kernel multiplies it by r^8…r^1 lane by lane as usual, so
//     its blocks get r^t…r^1, and multiplies everything before it by r^t more.
//
// What is not read in place (the head of ad with its zeros, ad's last chunk, the rest
// of ct and the lengths) is copied into a small staging buffer.

// ifmaState is the kernel's argument block: its offsets are fixed in _asm/main.go.
type ifmaState struct {
	r  [3]uint64 // r in radix 2^44
	kZ uint64    // lanes of the first regular chunk holding leading zero blocks
	kT uint64    // lanes of the tail chunk holding no block
	pk uint64    // the lane that holds block 8−t of a chunk
	h  [3]uint64 // out: the limb sums of the final lanes, each below 2^48
}

// segment is a run of whole chunks for the kernel.
type segment struct {
	p *byte
	n int // a positive multiple of 128
}

// maxSegments: the staged head of ad, ad's whole chunks, ad's staged last chunk, ct's
// whole chunks, a staged last chunk of ct.
const maxSegments = 5

//go:noescape
func polyIFMA(st *ifmaState, segs *[maxSegments]segment, regular int, tail *byte)

const mask44 = 1<<44 - 1

// laneOf is the kernel lane that holds block b of a chunk: the kernel's unpacking
// leaves blocks in the order 0 4 1 5 2 6 3 7.
func laneOf(b int) int {
	if b < 4 {
		return 2 * b
	}
	return 2*(b-4) + 1
}

// lanesBelow[n] is the mask of the lanes holding blocks 0…n−1 of a chunk. (Lengths
// are public; a table indexed by them leaks nothing.)
var lanesBelow = [9]uint64{0x00, 0x01, 0x05, 0x15, 0x55, 0x57, 0x5f, 0x7f, 0xff}

// stagingFast is the staging that ad of at most 128 bytes needs when the tail of ct
// and the lengths fit one chunk: ad's chunk and the tail chunk.
const stagingFast = 256

// sumIFMA is SumAEAD's vector path.
func sumIFMA(tag *[16]byte, key *[32]byte, ad, ct []byte) {
	if len(ad) > 128 || len(ct)%128 > 112 {
		sumIFMASlow(tag, key, ad, ct)
		return
	}
	var buf [stagingFast]byte
	h0, h1, h2 := hashIFMA(buf[:], key, ad, ct, true)
	finish(tag, key, h0, h1, h2)
}

// sumIFMASlow stages up to four chunks: ad's head and last chunk, ct's last chunk and
// the tail.
//
//go:noinline
func sumIFMASlow(tag *[16]byte, key *[32]byte, ad, ct []byte) {
	var buf [4 * 128]byte
	h0, h1, h2 := hashIFMA(buf[:], key, ad, ct, true)
	finish(tag, key, h0, h1, h2)
}

// hashIFMA plans the segments with staging buf (zero, big enough), runs the kernel and
// returns h before the final reduction, partly reduced (h2 ≤ 4). Without lengths (for
// tests of raw messages) the input is ad || pad || ct || pad, which needs at least one
// block.
func hashIFMA(buf []byte, key *[32]byte, ad, ct []byte, lengths bool) (h0, h1, h2 uint64) {
	var segs [maxSegments]segment
	var st ifmaState
	ns, regular, used := 0, 0, 0
	if a := (len(ad) + 15) / 16; a > 0 {
		z := -a & 7
		head := min(len(ad), 128-16*z)
		copy(buf[16*z:128], ad[:head])
		segs[ns] = segment{&buf[0], 128}
		ns, regular, used = ns+1, regular+1, 128
		st.kZ = lanesBelow[z]
		// The rest of ad is a whole number of chunks once padded.
		rest := ad[head:]
		if w := len(rest) &^ 127; w > 0 {
			segs[ns] = segment{&rest[0], w}
			ns, regular = ns+1, regular+w/128
			rest = rest[w:]
		}
		if len(rest) > 0 {
			copy(buf[used:used+128], rest)
			segs[ns] = segment{&buf[used], 128}
			ns, regular, used = ns+1, regular+1, used+128
		}
	}
	whole := len(ct) / 128
	if whole > 0 {
		segs[ns] = segment{&ct[0], 128 * whole}
		ns, regular = ns+1, regular+whole
	}
	rest := ct[128*whole:]
	t := (len(rest) + 15) / 16
	if lengths {
		t++
	} else if t == 0 { // ct's last chunk is the tail
		whole--
		segs[ns-1].n -= 128
		if segs[ns-1].n == 0 {
			ns--
		}
		regular--
		rest, t = ct[128*whole:], 8
	}
	if t > 8 { // the rest of ct is a chunk of its own; the tail is the lengths
		copy(buf[used:used+128], rest)
		segs[ns] = segment{&buf[used], 128}
		ns, regular, used = ns+1, regular+1, used+128
		rest, t = nil, 1
	}
	tail := buf[used : used+128]
	copy(tail[128-16*t:], rest)
	if lengths {
		binary.LittleEndian.PutUint64(tail[112:120], uint64(len(ad)))
		binary.LittleEndian.PutUint64(tail[120:128], uint64(len(ct)))
	}
	st.kT = lanesBelow[8-t]
	st.pk = uint64(laneOf(8 - t))

	st.r = rLimbs(key)
	polyIFMA(&st, &segs, regular, &tail[0])
	// h = h[0] + h[1]·2^44 + h[2]·2^88; then fold the bits above 2^130 (2^130 ≡ 5).
	h0, h1, h2 = join44(st.h[0], st.h[1], st.h[2])
	top := h2 >> 2
	var c uint64
	h0, c = bits.Add64(h0, top*5, 0)
	h1, c = bits.Add64(h1, 0, c)
	return h0, h1, h2&3 + c
}

// rLimbs is key's r, clamped as RFC 8439 §2.5.1 says, in radix 2^44.
func rLimbs(key *[32]byte) [3]uint64 {
	r0 := binary.LittleEndian.Uint64(key[0:8]) & 0x0ffffffc0fffffff
	r1 := binary.LittleEndian.Uint64(key[8:16]) & 0x0ffffffc0ffffffc
	return [3]uint64{r0 & mask44, (r0>>44 | r1<<20) & mask44, r1 >> 24}
}

// join44 is l0 + l1·2^44 + l2·2^88 as 64-bit words h0, h1, h2 (l0, l1 < 2^48 and
// l2 < 2^48, so h2 < 2^8).
func join44(l0, l1, l2 uint64) (h0, h1, h2 uint64) {
	h0, c := bits.Add64(l0, l1<<44, 0)
	h1, c = bits.Add64(l1>>20, l2<<24, c)
	return h0, h1, l2>>40 + c
}

// finish writes (h mod 2^130−5) + s mod 2^128 to tag, s being key[16:32]; h2 ≤ 7.
func finish(tag *[16]byte, key *[32]byte, h0, h1, h2 uint64) {
	// Folding h2's bits above 2^130 leaves h < 2^130 + 5.
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

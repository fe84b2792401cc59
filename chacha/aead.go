package chacha

import "encoding/binary"

// XORKeyStreamXAEAD is the keystream half of XChaCha20-Poly1305
// (draft-irtf-cfrg-xchacha-03 §2.3 over RFC 8439 §2.8) for n = len(nonces)/24 messages
// of len(src)/n bytes each, as disk sectors are: for message i with nonce
// nonces[24i:24i+24] and subkey HChaCha20(key, nonce[0:16]), it writes the first 32
// bytes of ChaCha20 block 0, the message's one-time Poly1305 key (RFC 8439 §2.6), to
// polyKeys[32i:32i+32], and XORs the message into dst with the keystream from block 1.
// The Poly1305 half is the caller's. Subkeys come 16 (or 8) at a time from
// HChaChaMany's kernels and the sixteen blocks 0 from one more pass of lanes, so the
// AEAD's extra block costs a message about 1/16 of a block instead of one. It allocates
// nothing and wipes the subkeys and blocks it made. It panics where XORKeyStreamXMany
// does, and if len(polyKeys) is not 32·n or polyKeys overlaps dst.
func XORKeyStreamXAEAD(key *[KeySize]byte, nonces, polyKeys, dst, src []byte) {
	xorAEAD(defaultEngine, key, nonces, polyKeys, dst, src)
}

// polyKeySize is the length of a Poly1305 one-time key.
const polyKeySize = 32

func xorAEAD(e engine, key *[KeySize]byte, nonces, polyKeys, dst, src []byte) {
	const rounds = 20
	m := checkMany(rounds, NonceSizeX, nonces, dst, src)
	n := len(nonces) / NonceSizeX
	if len(polyKeys) != n*polyKeySize {
		panic("chacha: XORKeyStreamXAEAD needs 32 bytes of Poly1305 key room per message")
	}
	if overlap(polyKeys, dst[:len(src)]) || overlap(polyKeys, nonces) {
		panic("chacha: Poly1305 keys overlap the output or the nonces")
	}
	var st, ms [16]uint32
	initState(&st, key)
	var hn [manyChunk * HNonceSize]byte
	var sub [manyChunk * hSubkeySize]byte
	var in [16][16]uint32
	var out [8][16]uint32
	for i := 0; i < n; i += manyChunk {
		c := min(manyChunk, n-i)
		for j := range c {
			*(*[HNonceSize]byte)(hn[j*HNonceSize:]) = *(*[HNonceSize]byte)(nonces[(i+j)*NonceSizeX:])
		}
		hchachaManyEngine(e, &st, rounds, hn[:c*HNonceSize], sub[:c*hSubkeySize])
		// Lane j: the XChaCha state of message i+j at counter 0. Lanes past c keep
		// whatever they held; their blocks are not used.
		for j := range c {
			xs := xStateOf(sub[j*hSubkeySize:], nonces[(i+j)*NonceSizeX+16:])
			for w := range xs {
				in[w][j] = xs[w]
			}
		}
		firstBlocks(e, &in, &out, c, rounds)
		for j := range c {
			pk := polyKeys[(i+j)*polyKeySize:]
			for w := range 8 {
				binary.LittleEndian.PutUint32(pk[4*w:], out[w][j])
			}
			if m == 0 {
				continue
			}
			ms = xStateOf(sub[j*hSubkeySize:], nonces[(i+j)*NonceSizeX+16:])
			ms[12] = 1
			at := (i + j) * m
			xorKeyStream(e, &ms, rounds, false, dst[at:at+m], src[at:at+m])
		}
	}
	clear(sub[:])
	clear(ms[:])
	clear(st[4:12])
	in = [16][16]uint32{}
	out = [8][16]uint32{}
}

// xStateOf is the XChaCha state (draft-irtf-cfrg-xchacha-03 §2.3) for subkey sub and
// the last 8 nonce bytes tail: the subkey as key, counter 0, nonce 0x00000000 ‖ tail.
func xStateOf(sub, tail []byte) [16]uint32 {
	var s [16]uint32
	initState(&s, (*[KeySize]byte)(sub))
	s[14] = binary.LittleEndian.Uint32(tail[0:])
	s[15] = binary.LittleEndian.Uint32(tail[4:])
	return s
}

// firstBlocksGeneric is firstBlocksAVX512 in Go for the first lanes lanes: for each
// lane l of the word-sliced states in, words 0..7 of lane l's keystream block into
// out[·][l].
func firstBlocksGeneric(in *[16][16]uint32, out *[8][16]uint32, lanes, rounds int) {
	for l := range lanes {
		var x, s [16]uint32
		for w := range s {
			s[w] = in[w][l]
		}
		x = s
		permute(&x, rounds)
		for w := range 8 {
			out[w][l] = x[w] + s[w]
		}
		clear(x[:])
		clear(s[:])
	}
}

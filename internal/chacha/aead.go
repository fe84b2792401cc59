package chacha

import (
	"encoding/binary"
	"fmt"

	"github.com/elidisk/eli/internal/wipe"
)

// XChaCha20-Poly1305 (draft-irtf-cfrg-xchacha-03 §2.3 over RFC 8439 §2.8) for runs of
// disk sectors, split in the two steps an AEAD needs in either order: XAEADKeys derives
// each message's subkey and one-time Poly1305 key, XORKeyStreamSubkeys encrypts (or
// decrypts) with those subkeys. Sealing calls one after the other; opening checks the
// tags in between, so nothing is decrypted before it is authenticated, and nothing is
// derived twice. The Poly1305 half is the caller's.

// SubkeySize is the length of one XChaCha subkey, PolyKeySize of one Poly1305 one-time key.
const (
	SubkeySize  = 32
	PolyKeySize = 32
)

// XAEADKeys derives, for each of the n = len(nonces)/24 XChaCha20-Poly1305 nonces, the
// subkey HChaCha20(key, nonce[0:16]) into subkeys[32i:32i+32] and the first 32 bytes of
// ChaCha20 block 0 under that subkey and nonce 0⁴ ‖ nonce[16:24], the message's one-time
// Poly1305 key (RFC 8439 §2.6), into polyKeys[32i:32i+32]. Subkeys come 16 (or 8) at a
// time from HChaChaMany's kernels and the blocks 0 from one more pass of lanes, so the
// AEAD's extra block costs a message about 1/16 of a block instead of one; a lone nonce
// takes the scalar code, which for one message costs less than a pass of lanes. It allocates
// nothing. It panics if len(nonces) is not a multiple of 24, if subkeys or polyKeys is
// not 32·n bytes, or if any two of the three overlap.
func XAEADKeys(key *[KeySize]byte, nonces, subkeys, polyKeys []byte) {
	wipe.Stack()
	xaeadKeys(defaultEngine, key, nonces, subkeys, polyKeys)
	wipe.Stack()
}

// XORKeyStreamSubkeys XORs src into dst as n = len(nonces)/24 consecutive messages of
// len(src)/n bytes, message i with ChaCha20 under subkeys[32i:32i+32] and nonce
// 0⁴ ‖ nonces[24i+16:24i+24] from block 1: XChaCha20-Poly1305's encryption, with the
// subkeys XAEADKeys made. It allocates nothing. It panics where XORKeyStreamXMany does,
// and if subkeys is not 32·n bytes or overlaps dst.
func XORKeyStreamSubkeys(subkeys, nonces, dst, src []byte) {
	xorSubkeys(defaultEngine, subkeys, nonces, dst, src)
}

const aeadRounds = 20

// xaeadKeys, like the other functions the exported ones that take a key call, holds the
// key's words on the stack: every exported function that takes a key calls its worker
// between two wipe.Stack calls, and the workers stay out of line so that their frames
// lie below the wrapper's, where the second call zeroes them (docs/threat-model.md,
// "Suspend").
//
//go:noinline
func xaeadKeys(e engine, key *[KeySize]byte, nonces, subkeys, polyKeys []byte) {
	if len(nonces)%NonceSizeX != 0 {
		panic(fmt.Sprintf("chacha: given %d bytes of nonces, not a multiple of %d", len(nonces), NonceSizeX))
	}
	n := len(nonces) / NonceSizeX
	if len(subkeys) != n*SubkeySize || len(polyKeys) != n*PolyKeySize {
		panic("chacha: XAEADKeys needs 32 bytes of subkey and 32 of Poly1305 key room per nonce")
	}
	if overlap(subkeys, nonces) || overlap(polyKeys, nonces) || overlap(subkeys, polyKeys) {
		panic("chacha: XAEADKeys given overlapping nonces, subkeys or Poly1305 keys")
	}
	if n == 1 {
		// A lone message (a random 4 KiB write): the vector kernels would fill every lane
		// for one, and cost more than the scalar code for its two blocks (BenchmarkXAEADKeys).
		xaeadKeysOne(key, nonces, subkeys, polyKeys)
		return
	}
	var st [16]uint32
	initState(&st, key)
	var hn [manyChunk * HNonceSize]byte
	var in [16][16]uint32
	var out [8][16]uint32
	for i := 0; i < n; i += manyChunk {
		c := min(manyChunk, n-i)
		for j := range c {
			*(*[HNonceSize]byte)(hn[j*HNonceSize:]) = *(*[HNonceSize]byte)(nonces[(i+j)*NonceSizeX:])
		}
		sub := subkeys[i*SubkeySize : (i+c)*SubkeySize]
		hchachaManyEngine(e, &st, aeadRounds, hn[:c*HNonceSize], sub)
		// Lane j: the XChaCha state of message i+j at counter 0. Lanes past c keep
		// whatever they held; their blocks are not used.
		for j := range c {
			xs := xStateOf(sub[j*SubkeySize:], nonces[(i+j)*NonceSizeX+16:])
			for w := range xs {
				in[w][j] = xs[w]
			}
		}
		firstBlocks(e, &in, &out, c, aeadRounds)
		for j := range c {
			pk := polyKeys[(i+j)*PolyKeySize:]
			for w := range 8 {
				binary.LittleEndian.PutUint32(pk[4*w:], out[w][j])
			}
		}
	}
	clear(st[4:12])
	in = [16][16]uint32{}
	out = [8][16]uint32{}
}

// xaeadKeysOne is xaeadKeys for one nonce, with the portable code.
func xaeadKeysOne(key *[KeySize]byte, nonce, subkey, polyKey []byte) {
	var st [16]uint32
	initState(&st, key)
	hchachaManyGeneric(&st, aeadRounds, nonce[:HNonceSize], subkey)
	clear(st[4:12])
	x := xStateOf(subkey, nonce[16:])
	var block [BlockSize]byte
	blockGeneric(&x, aeadRounds, &block)
	copy(polyKey[:PolyKeySize], block[:])
	clear(x[:])
	clear(block[:])
}

func xorSubkeys(e engine, subkeys, nonces, dst, src []byte) {
	m := checkMany(aeadRounds, NonceSizeX, nonces, dst, src)
	n := len(nonces) / NonceSizeX
	if len(subkeys) != n*SubkeySize {
		panic("chacha: XORKeyStreamSubkeys needs 32 bytes of subkey per nonce")
	}
	if overlap(subkeys, dst[:len(src)]) {
		panic("chacha: subkeys overlap the output")
	}
	if m == 0 {
		return
	}
	for i := range n {
		ms := xStateOf(subkeys[i*SubkeySize:], nonces[i*NonceSizeX+16:])
		ms[12] = 1
		xorKeyStream(e, &ms, aeadRounds, false, dst[i*m:(i+1)*m], src[i*m:(i+1)*m])
		clear(ms[:])
	}
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

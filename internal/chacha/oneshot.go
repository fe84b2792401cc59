package chacha

import (
	"encoding/binary"
	"fmt"

	"github.com/elidisk/eli/internal/wipe"
)

// XORKeyStreamAt XORs src into dst with the RFC 8439 keystream of (rounds, key, nonce)
// starting at block counter: the bytes New, SetCounter(counter) and XORKeyStream would
// give, without allocating or keeping state, so that it can run once per disk sector
// from many goroutines. It panics if rounds is not 8, 12 or 20, if dst is shorter than
// src, if they overlap inexactly, or if src runs past block 2^32−1.
func XORKeyStreamAt(rounds int, key *[KeySize]byte, nonce *[NonceSize]byte, counter uint32, dst, src []byte) {
	wipe.Stack()
	xorKeyStreamAt(rounds, key, nonce, counter, dst, src)
	wipe.Stack()
}

//go:noinline
func xorKeyStreamAt(rounds int, key *[KeySize]byte, nonce *[NonceSize]byte, counter uint32, dst, src []byte) {
	var st [16]uint32
	initState(&st, key)
	st[12] = counter
	st[13] = binary.LittleEndian.Uint32(nonce[0:])
	st[14] = binary.LittleEndian.Uint32(nonce[4:])
	st[15] = binary.LittleEndian.Uint32(nonce[8:])
	xorAt(defaultEngine, &st, rounds, dst, src)
}

// XORKeyStreamXAt is XORKeyStreamAt for XChaCha: the bytes NewX, SetCounter(counter) and
// XORKeyStream would give. It computes one HChaCha per call.
func XORKeyStreamXAt(rounds int, key *[KeySize]byte, nonce *[NonceSizeX]byte, counter uint32, dst, src []byte) {
	wipe.Stack()
	xorKeyStreamXAt(rounds, key, nonce, counter, dst, src)
	wipe.Stack()
}

//go:noinline
func xorKeyStreamXAt(rounds int, key *[KeySize]byte, nonce *[NonceSizeX]byte, counter uint32, dst, src []byte) {
	var st [16]uint32
	xState(&st, rounds, key, nonce)
	st[12] = counter
	xorAt(defaultEngine, &st, rounds, dst, src)
	clear(st[4:12]) // the subkey
}

// xorAt checks the arguments of the one-shot functions and runs engine e on st, whose
// 32-bit counter is the first block.
func xorAt(e engine, st *[16]uint32, rounds int, dst, src []byte) {
	if err := checkRounds(rounds); err != nil {
		panic(err.Error())
	}
	if len(dst) < len(src) {
		panic("chacha: output smaller than input")
	}
	dst = dst[:len(src)]
	if inexactOverlap(dst, src) {
		panic("chacha: invalid buffer overlap")
	}
	if blocks := (uint64(len(src)) + BlockSize - 1) / BlockSize; blocks > 1<<32-uint64(st[12]) {
		panic(fmt.Sprintf("%s (counter %d, %d bytes)", exhausted, st[12], len(src)))
	}
	xorKeyStream(e, st, rounds, false, dst, src)
}

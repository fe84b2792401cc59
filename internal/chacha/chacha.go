// Package chacha implements the ChaCha stream cipher with 8, 12 or 20 rounds, HChaCha
// and XChaCha, in the style of golang.org/x/crypto/chacha20 (which has 20 rounds only
// and no amd64 assembly).
//
// Layouts (all words little-endian):
//
//   - New: RFC 8439 §2.3, a 96-bit nonce and a 32-bit block counter (word 12).
//   - New64: the original layout, a 64-bit nonce (words 14-15) and a 64-bit block
//     counter (words 12-13).
//   - NewX: XChaCha (draft-irtf-cfrg-xchacha-03 §2.3): HChaCha of the same round count
//     turns the key and the first 16 nonce bytes into a subkey, used with the RFC 8439
//     layout and the nonce 0x00000000 ‖ nonce[16:24].
//
// On amd64 the bulk of the keystream comes from AVX-512 (16 blocks at a time) or AVX2
// (8 blocks) assembly, picked at startup; other machines and the purego build tag use
// Go. All paths produce identical bytes.
//
// Runs of short messages with one nonce each, as disk sectors are, have their own calls:
// XORKeyStreamMany and XORKeyStreamXMany, which for XChaCha compute the messages'
// HChaCha subkeys 16 (AVX-512) or 8 (AVX2) at a time, one per vector lane
// (HChaChaMany). One HChaCha alone is a chain of dependent operations, a noticeable
// share of a 4 KiB message's keystream; in lanes it is a small one (BenchmarkHChaChaMany
// against BenchmarkKeystream; docs/benchmarks.md, "Measurements behind design choices").
//
// # Counter exhaustion
//
// A (key, nonce) pair yields 2^32 blocks (256 GiB) with a 32-bit counter and 2^64 blocks
// with a 64-bit one, counting from block 0; the block with the highest counter is
// usable. XORKeyStream panics, before writing anything, when src is longer than what
// remains. The counter never wraps: a wrapped counter would repeat keystream, which for
// a stream cipher discloses plaintext. This is the behaviour of x/crypto/chacha20 too.
package chacha

import (
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"
)

const (
	KeySize     = 32 // bytes of key
	NonceSize   = 12 // RFC 8439 nonce (32-bit counter)
	NonceSize64 = 8  // original ChaCha nonce (64-bit counter)
	NonceSizeX  = 24 // XChaCha nonce
	HNonceSize  = 16 // HChaCha input
	BlockSize   = 64 // bytes of keystream per block counter value
)

const exhausted = "chacha: keystream exhausted: the block counter would wrap"

// Cipher is a ChaCha keystream positioned at some block. It implements cipher.Stream.
// It is not safe for concurrent use.
type Cipher struct {
	st     [16]uint32 // word 12 (and 13 if ctr64) is the next block's counter
	rounds int
	ctr64  bool
	done   bool            // the block with the largest counter has been generated
	buf    [BlockSize]byte // keystream of the block last split by XORKeyStream
	off    int             // bytes of buf used up; BlockSize means none are left
	eng    engine          // tests force each engine through this field
}

func checkRounds(rounds int) error {
	switch rounds {
	case 8, 12, 20:
		return nil
	}
	return fmt.Errorf("chacha: %d rounds requested, only 8, 12 and 20 are implemented", rounds)
}

func checkLen(what string, got, want int) error {
	if got != want {
		return fmt.Errorf("chacha: %s must be %d bytes, got %d", what, want, got)
	}
	return nil
}

// New returns a ChaCha cipher with the RFC 8439 layout: a 12-byte nonce and a 32-bit
// block counter starting at 0.
func New(rounds int, key, nonce []byte) (*Cipher, error) {
	if err := errors.Join(checkRounds(rounds), checkLen("key", len(key), KeySize),
		checkLen("nonce", len(nonce), NonceSize)); err != nil {
		return nil, err
	}
	c := &Cipher{rounds: rounds, off: BlockSize, eng: defaultEngine}
	initState(&c.st, (*[KeySize]byte)(key))
	c.st[13] = binary.LittleEndian.Uint32(nonce[0:])
	c.st[14] = binary.LittleEndian.Uint32(nonce[4:])
	c.st[15] = binary.LittleEndian.Uint32(nonce[8:])
	return c, nil
}

// New64 returns a ChaCha cipher with the original layout: an 8-byte nonce and a 64-bit
// block counter starting at 0.
func New64(rounds int, key, nonce []byte) (*Cipher, error) {
	if err := errors.Join(checkRounds(rounds), checkLen("key", len(key), KeySize),
		checkLen("nonce", len(nonce), NonceSize64)); err != nil {
		return nil, err
	}
	c := &Cipher{rounds: rounds, ctr64: true, off: BlockSize, eng: defaultEngine}
	initState(&c.st, (*[KeySize]byte)(key))
	c.st[14] = binary.LittleEndian.Uint32(nonce[0:])
	c.st[15] = binary.LittleEndian.Uint32(nonce[4:])
	return c, nil
}

// NewX returns an XChaCha cipher: a 24-byte nonce, HChaCha with the same round count,
// and a 32-bit block counter starting at 0 (draft-irtf-cfrg-xchacha-03 §2.3).
func NewX(rounds int, key, nonce []byte) (*Cipher, error) {
	if err := errors.Join(checkRounds(rounds), checkLen("key", len(key), KeySize),
		checkLen("nonce", len(nonce), NonceSizeX)); err != nil {
		return nil, err
	}
	c := &Cipher{rounds: rounds, off: BlockSize, eng: defaultEngine}
	xState(&c.st, rounds, (*[KeySize]byte)(key), (*[NonceSizeX]byte)(nonce))
	return c, nil
}

// HChaCha returns the HChaCha subkey of key and a 16-byte nonce with rounds rounds: the
// ChaCha permutation of (constants, key, nonce) without the final addition, words 0-3
// and 12-15 (draft-irtf-cfrg-xchacha-03 §2.2).
func HChaCha(rounds int, key, nonce []byte) ([32]byte, error) {
	var out [32]byte
	if err := errors.Join(checkRounds(rounds), checkLen("key", len(key), KeySize),
		checkLen("nonce", len(nonce), HNonceSize)); err != nil {
		return out, err
	}
	var st [16]uint32
	initState(&st, (*[KeySize]byte)(key))
	for i := 0; i < 4; i++ {
		st[12+i] = binary.LittleEndian.Uint32(nonce[4*i:])
	}
	sub := hchacha(&st, rounds)
	for i, v := range sub {
		binary.LittleEndian.PutUint32(out[4*i:], v)
	}
	return out, nil
}

func initState(st *[16]uint32, key *[KeySize]byte) {
	st[0], st[1], st[2], st[3] = sigma0, sigma1, sigma2, sigma3
	for i := 0; i < 8; i++ {
		st[4+i] = binary.LittleEndian.Uint32(key[4*i:])
	}
}

// hchacha permutes st (constants, key, 16-byte nonce) and returns the subkey words.
func hchacha(st *[16]uint32, rounds int) [8]uint32 {
	return hchachaEngine(defaultEngine, st, rounds)
}

// xState sets st up for XChaCha: the HChaCha subkey as key, counter 0, and the nonce
// 0x00000000 ‖ nonce[16:24].
func xState(st *[16]uint32, rounds int, key *[KeySize]byte, nonce *[NonceSizeX]byte) {
	initState(st, key)
	for i := 0; i < 4; i++ {
		st[12+i] = binary.LittleEndian.Uint32(nonce[4*i:])
	}
	sub := hchacha(st, rounds)
	copy(st[4:12], sub[:])
	st[12], st[13] = 0, 0
	st[14] = binary.LittleEndian.Uint32(nonce[16:])
	st[15] = binary.LittleEndian.Uint32(nonce[20:])
}

func (c *Cipher) counter() uint64 {
	if c.ctr64 {
		return uint64(c.st[12]) | uint64(c.st[13])<<32
	}
	return uint64(c.st[12])
}

// SetCounter positions the keystream at the start of block n, as if 64·n bytes had been
// used, and drops any keystream left from a partial block. Unlike x/crypto/chacha20's,
// it may move backwards: random access is what a disk needs, and not reusing a position
// under one (key, nonce) is then the caller's job. It panics if n does not fit the
// cipher's counter (n ≥ 2^32 for New and NewX).
func (c *Cipher) SetCounter(n uint64) {
	if !c.ctr64 && n > 1<<32-1 {
		panic(fmt.Sprintf("chacha: counter %d does not fit in 32 bits", n))
	}
	c.st[12] = uint32(n)
	if c.ctr64 {
		c.st[13] = uint32(n >> 32)
	}
	c.done = false
	c.off = BlockSize
	clear(c.buf[:])
}

// fits reports whether n more bytes of keystream remain.
func (c *Cipher) fits(n int) bool {
	left := BlockSize - c.off
	if n <= left {
		return true
	}
	if c.done {
		return false
	}
	need := (uint64(n-left) + BlockSize - 1) / BlockSize
	ctr := c.counter()
	if c.ctr64 {
		return ctr == 0 || need <= -ctr // -ctr is 2^64 - ctr blocks
	}
	return need <= 1<<32-ctr
}

// advance moves the counter past n generated blocks (fits has been checked).
func (c *Cipher) advance(n uint64) {
	next := c.counter() + n
	if c.ctr64 {
		c.done = next == 0 // wrapped exactly to 2^64
	} else {
		c.done = next == 1<<32
	}
	advanceState(&c.st, n, c.ctr64)
}

// XORKeyStream XORs each byte of src with the next byte of keystream into dst.
// Successive calls continue the keystream. dst must be at least as long as src; dst
// and src must overlap entirely or not at all. It panics, before writing anything, if
// the keystream left under this (key, nonce) is shorter than src.
func (c *Cipher) XORKeyStream(dst, src []byte) {
	if len(src) == 0 {
		return
	}
	if len(dst) < len(src) {
		panic("chacha: output smaller than input")
	}
	dst = dst[:len(src)]
	if inexactOverlap(dst, src) {
		panic("chacha: invalid buffer overlap")
	}
	if !c.fits(len(src)) {
		panic(exhausted)
	}
	if c.off < BlockSize {
		n := subtle.XORBytes(dst, src, c.buf[c.off:])
		c.off += n
		dst, src = dst[n:], src[n:]
	}
	if n := len(src) &^ (BlockSize - 1); n > 0 {
		xorKeyStream(c.eng, &c.st, c.rounds, c.ctr64, dst[:n], src[:n])
		c.advance(uint64(n / BlockSize))
		dst, src = dst[n:], src[n:]
	}
	if len(src) > 0 {
		blockGeneric(&c.st, c.rounds, &c.buf)
		c.advance(1)
		c.off = subtle.XORBytes(dst, src, c.buf[:])
	}
}

// inexactOverlap reports whether x and y share memory without starting at the same
// address: in-place operation is fine, a shifted overlap would read bytes it already
// wrote.
func inexactOverlap(x, y []byte) bool {
	if len(x) == 0 || len(y) == 0 || &x[0] == &y[0] {
		return false
	}
	xs, ys := uintptr(unsafe.Pointer(&x[0])), uintptr(unsafe.Pointer(&y[0]))
	return xs <= ys+uintptr(len(y)-1) && ys <= xs+uintptr(len(x)-1)
}

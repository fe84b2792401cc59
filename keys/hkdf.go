package keys

import (
	"crypto/sha256"
	"hash"
)

// HMAC-SHA256 and HKDF-SHA256 (RFC 2104, RFC 5869) with every key-equivalent value in a
// Secret: the HMAC pads (the key XOR a constant), the inner hash, the PRK and each output
// block T(i). crypto/hmac and crypto/hkdf compute the same bytes, but keep these values in
// heap memory that they drop without clearing, where they stay until the memory is
// reused: a derived key wiped by its caller was still in the process's memory, in
// crypto/hkdf's last T(i) (TestDerivedKeysLeaveNoCopy). The SHA-256 itself is
// crypto/sha256; what it keeps of a message (the partial block) is overwritten after use.

const (
	hmacBlock = sha256.BlockSize // 64
	hmacSize  = sha256.Size      // 32
)

// keyedHash computes HMAC-SHA256 with its scratch in a Secret. Wipe it when done.
type keyedHash struct {
	h       hash.Hash
	scratch *Secret // ipad ‖ opad ‖ inner hash
}

func newKeyedHash() *keyedHash {
	return &keyedHash{h: sha256.New(), scratch: NewSecret(2*hmacBlock + hmacSize)}
}

// sum writes HMAC-SHA256(key, parts...) into dst (at least 32 bytes). key is at most one
// block, as every key here is.
func (k *keyedHash) sum(dst, key []byte, parts ...[]byte) {
	if len(key) > hmacBlock {
		panic("keys: HMAC key longer than a SHA-256 block")
	}
	s := k.scratch.Bytes()
	ipad, opad, inner := s[:hmacBlock], s[hmacBlock:2*hmacBlock], s[2*hmacBlock:]
	clear(ipad)
	copy(ipad, key)
	copy(opad, ipad)
	for i := range ipad {
		ipad[i] ^= 0x36
		opad[i] ^= 0x5c
	}
	k.h.Reset()
	k.h.Write(ipad)
	for _, p := range parts {
		k.h.Write(p)
	}
	k.h.Sum(inner[:0])
	k.h.Reset()
	k.h.Write(opad)
	k.h.Write(inner)
	k.h.Sum(dst[:0])
}

// wipe clears the scratch and what the hash keeps of the last message: a partial block,
// which the 63 zero bytes written after a Reset overwrite.
func (k *keyedHash) wipe() {
	var zero [hmacBlock - 1]byte
	k.h.Reset()
	k.h.Write(zero[:])
	k.h.Reset()
	k.scratch.Wipe()
}

// hkdfSHA256 fills out with HKDF-SHA256(secret, salt, info) (RFC 5869): extract, then
// expand. out may be at most 255 blocks of 32 bytes; it should be a Secret's bytes.
// It stays out of line so that its frames lie below derive's, where wipe.Stack zeroes them.
//
//go:noinline
func hkdfSHA256(out, secret, salt []byte, info string) {
	if len(out) > 255*hmacSize {
		panic("keys: HKDF output too long")
	}
	k := newKeyedHash()
	defer k.wipe()
	t := NewSecret(2 * hmacSize) // PRK ‖ T(i)
	defer t.Wipe()
	prk, block := t.Bytes()[:hmacSize], t.Bytes()[hmacSize:]
	if len(salt) == 0 {
		salt = make([]byte, hmacSize) // RFC 5869 section 2.2: HashLen zeros
	}
	k.sum(prk, salt, secret)
	var prev []byte // T(0) is empty
	for i := 1; len(out) > 0; i++ {
		k.sum(block, prk, prev, []byte(info), []byte{byte(i)})
		n := copy(out, block)
		out = out[n:]
		prev = block
	}
}

package poly1305

import (
	"encoding/binary"

	"golang.org/x/crypto/poly1305"
)

// sumGeneric feeds the MAC input to x/crypto's Poly1305 piece by piece; x/crypto has
// its own assembly on amd64 (MULX) and other architectures.
func sumGeneric(tag *[16]byte, key *[32]byte, ad, ct []byte) {
	var pad [16]byte
	m := poly1305.New(key)
	m.Write(ad)
	m.Write(pad[:padLen(len(ad))])
	m.Write(ct)
	m.Write(pad[:padLen(len(ct))])
	var lens [16]byte
	binary.LittleEndian.PutUint64(lens[0:8], uint64(len(ad)))
	binary.LittleEndian.PutUint64(lens[8:16], uint64(len(ct)))
	m.Write(lens[:])
	m.Sum(tag[:0])
}

// padLen is the number of zero bytes that pad n bytes to a multiple of 16.
func padLen(n int) int { return -n & 15 }

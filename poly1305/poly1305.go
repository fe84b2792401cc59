// Package poly1305 computes the Poly1305 tag of ChaCha20-Poly1305's MAC input (RFC 8439
// §2.8) straight from the additional data and the ciphertext, for eli's per-sector
// XChaCha20-Poly1305.
//
// On amd64 CPUs with AVX-512 IFMA one assembly kernel computes the whole MAC input,
// eight 16-byte blocks at a time in radix 2^44 (ifma.go, _asm/main.go); Go code only
// stages the few blocks that cannot be read in place and does the final reduction.
// Elsewhere, and with -tags purego, golang.org/x/crypto/poly1305 computes the tag.
package poly1305

// TagSize is the size of a Poly1305 tag; KeySize of its one-time key.
const TagSize, KeySize = 16, 32

// SumAEAD computes the Poly1305 tag of RFC 8439 §2.8's MAC input for additional data ad
// and ciphertext ct, without building that input:
//
//	ad || zero pad to 16 || ct || zero pad to 16 || le64(len(ad)) || le64(len(ct))
//
// key is the one-time key (r || s); it must never be used for a second message.
func SumAEAD(tag *[16]byte, key *[32]byte, ad, ct []byte) {
	sumAEAD(defaultPath, tag, key, ad, ct)
}

// Accelerated reports whether SumAEAD runs the vector kernel on this machine.
func Accelerated() bool { return defaultPath == pathIFMA }

// path names one implementation of SumAEAD. Every path produces the same tags; tests
// run each one the machine supports, whatever defaultPath is.
type path uint8

const (
	pathGeneric path = iota // golang.org/x/crypto/poly1305
	pathIFMA                // AVX-512 IFMA kernel
)

func (p path) String() string {
	switch p {
	case pathGeneric:
		return "generic"
	case pathIFMA:
		return "ifma"
	}
	return "unknown"
}

// Package poly1305 computes the Poly1305 tag of ChaCha20-Poly1305's MAC input (RFC 8439
// §2.8) straight from the additional data and the ciphertext, for eli's per-sector
// XChaCha20-Poly1305.
//
// On amd64 CPUs with AVX-512 IFMA one assembly kernel computes the whole MAC input,
// eight 16-byte blocks at a time in radix 2^44 (ifma.go, _asm/main.go); Go code only
// stages the few blocks that cannot be read in place and does the final reduction.
// SumAEADMany runs eight or sixteen messages of one shape side by side instead, one per
// lane (ifma_many.go, _asm/many.go): a run of disk sectors, whose tags then cost less
// than one message at a time, the more so the smaller the sectors (BenchmarkSumAEADMany;
// docs/benchmarks.md, "Measurements behind design choices").
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

// SumAEADMany computes the tags SumAEAD gives for n messages at once, n = len(tags)/16:
// tag i (tags[16i:16i+16]) under one-time key keys[32i:32i+32] for additional data
// ads[adLen·i:adLen·(i+1)] and ciphertext cts[ctLen·i:ctLen·(i+1)]. The vector path
// runs eight or sixteen such messages side by side, one per lane, when each ct is whole
// blocks and ad at most 64 bytes (the sectors of a run); other shapes, and what is left
// over, go through SumAEAD.
func SumAEADMany(tags, keys, ads []byte, adLen int, cts []byte, ctLen int) {
	sumAEADMany(defaultPath, tags, keys, ads, adLen, cts, ctLen)
}

// checkMany panics on lengths that do not describe len(tags)/16 messages: a bug in the
// caller, like a short key.
func checkMany(tags, keys, ads []byte, adLen int, cts []byte, ctLen int) int {
	n := len(tags) / TagSize
	if len(tags)%TagSize != 0 || adLen < 0 || ctLen < 0 || len(keys) != n*KeySize || len(ads) != n*adLen || len(cts) != n*ctLen {
		panic("poly1305: SumAEADMany given lengths that do not describe len(tags)/16 messages")
	}
	return n
}

// sumAEADManyOneByOne is SumAEADMany through SumAEAD's path p, message by message.
func sumAEADManyOneByOne(p path, tags, keys, ads []byte, adLen int, cts []byte, ctLen int) {
	for i := range len(tags) / TagSize {
		sumAEAD(p, (*[16]byte)(tags[16*i:]), (*[32]byte)(keys[32*i:]), ads[adLen*i:adLen*(i+1)], cts[ctLen*i:ctLen*(i+1)])
	}
}

package chacha

import (
	"strconv"
	"testing"

	"github.com/elidisk/eli/internal/cputime"
	"golang.org/x/crypto/chacha20"
)

var benchSizes = []int{512, 4096, 65536}

// BenchmarkKeystream measures one message per op with a fresh (key, nonce) setup, as a
// sector codec does: the one-shot entry points here, NewUnauthenticatedCipher plus
// XORKeyStream for golang.org/x/crypto/chacha20. XChaCha includes its HChaCha.
//
// Per message, XChaCha20 stays slower than ChaCha20, the more so the shorter the message:
// each message needs its own HChaCha20 first, 20 rounds on one state that form a single
// chain of dependent operations, which no vector width can shorten; only many nonces side
// by side fill the lanes. XORKeyStreamXMany does that for runs of sectors, and in
// BenchmarkSectors XChaCha20 comes close to ChaCha20, where at 512 B one subkey is still a
// ninth permutation beside the eight of the sector's keystream (docs/benchmarks.md,
// "Measurements behind design choices").
func BenchmarkKeystream(b *testing.B) {
	var key [KeySize]byte
	var nonce [NonceSize]byte
	var xnonce [NonceSizeX]byte
	impls := []struct {
		name string
		f    func(buf []byte)
	}{
		{"ChaCha8", func(buf []byte) { XORKeyStreamAt(8, &key, &nonce, 0, buf, buf) }},
		{"ChaCha12", func(buf []byte) { XORKeyStreamAt(12, &key, &nonce, 0, buf, buf) }},
		{"ChaCha20", func(buf []byte) { XORKeyStreamAt(20, &key, &nonce, 0, buf, buf) }},
		{"XChaCha8", func(buf []byte) { XORKeyStreamXAt(8, &key, &xnonce, 0, buf, buf) }},
		{"XChaCha12", func(buf []byte) { XORKeyStreamXAt(12, &key, &xnonce, 0, buf, buf) }},
		{"XChaCha20", func(buf []byte) { XORKeyStreamXAt(20, &key, &xnonce, 0, buf, buf) }},
		{"xcrypto-ChaCha20", func(buf []byte) {
			c, _ := chacha20.NewUnauthenticatedCipher(key[:], nonce[:])
			c.XORKeyStream(buf, buf)
		}},
		{"xcrypto-XChaCha20", func(buf []byte) {
			c, _ := chacha20.NewUnauthenticatedCipher(key[:], xnonce[:])
			c.XORKeyStream(buf, buf)
		}},
	}
	for _, size := range benchSizes {
		for _, im := range impls {
			b.Run(im.name+"/"+strconv.Itoa(size), func(b *testing.B) {
				buf := make([]byte, size)
				cputime.Loop(b, size, func() { im.f(buf) })
			})
		}
	}
}

// BenchmarkEngine runs ChaCha20 on each engine this machine has, to show what each
// SIMD path is worth.
func BenchmarkEngine(b *testing.B) {
	var st [16]uint32
	initState(&st, &[KeySize]byte{})
	for _, size := range benchSizes {
		for _, e := range engines() {
			b.Run(e.String()+"/"+strconv.Itoa(size), func(b *testing.B) {
				buf := make([]byte, size)
				cputime.Loop(b, size, func() { xorKeyStream(e, &st, 20, false, buf, buf) })
			})
		}
	}
}

// BenchmarkStream measures a long-lived Cipher fed 4 KiB at a time (no per-message
// setup), against x/crypto's.
func BenchmarkStream(b *testing.B) {
	key, nonce := make([]byte, KeySize), make([]byte, NonceSize)
	b.Run("ChaCha20", func(b *testing.B) {
		c, _ := New(20, key, nonce)
		buf := make([]byte, 4096)
		cputime.Loop(b, len(buf), func() { c.XORKeyStream(buf, buf) })
	})
	b.Run("xcrypto-ChaCha20", func(b *testing.B) {
		c, _ := chacha20.NewUnauthenticatedCipher(key, nonce)
		buf := make([]byte, 4096)
		cputime.Loop(b, len(buf), func() { c.XORKeyStream(buf, buf) })
	})
}

package chacha

import (
	"encoding/binary"
	"strconv"
	"testing"

	"github.com/elidisk/eli/internal/cputime"
)

// BenchmarkSectors encrypts a run of 256 consecutive disk sectors per op, one nonce per
// sector as sector/'s chacha*-xts and xchacha*-xts codecs derive them: ChaCha with the
// 12-byte nonce LE64(index) ‖ 0^4, XChaCha with the 24-byte nonce LE64(index) ‖ 0^16.
// "ChaChaN" and "XChaChaN" take the whole run in one XORKeyStreamMany or
// XORKeyStreamXMany call (XChaCha's HChaCha subkeys in batches); the "-each" variants
// make one XORKeyStreamAt or XORKeyStreamXAt call per sector (an HChaCha each). Compare
// cpu-ns/op of XChaChaN with ChaChaN, and of the -each pair, at the same sector size:
// the target is XChaCha20 within 10% of ChaCha20 at 4 KiB.
func BenchmarkSectors(b *testing.B) {
	const run = 256
	var key [KeySize]byte
	for i := range key {
		key[i] = byte(i)
	}
	for _, size := range []int{4096, 512} {
		for _, rounds := range []int{20, 12, 8} {
			rs := strconv.Itoa(rounds)
			sz := strconv.Itoa(size)
			buf := make([]byte, run*size)
			b.Run("ChaCha"+rs+"/"+sz, func(b *testing.B) {
				nonces := make([]byte, run*NonceSize)
				first := uint64(0)
				cputime.Loop(b, len(buf), func() {
					for i := range run {
						binary.LittleEndian.PutUint64(nonces[i*NonceSize:], first+uint64(i))
					}
					XORKeyStreamMany(rounds, &key, nonces, buf, buf)
					first += run
				})
			})
			b.Run("ChaCha"+rs+"-each/"+sz, func(b *testing.B) {
				first := uint64(0)
				cputime.Loop(b, len(buf), func() {
					var nonce [NonceSize]byte
					for i := range run {
						binary.LittleEndian.PutUint64(nonce[:], first+uint64(i))
						XORKeyStreamAt(rounds, &key, &nonce, 0, buf[i*size:(i+1)*size], buf[i*size:(i+1)*size])
					}
					first += run
				})
			})
			b.Run("XChaCha"+rs+"/"+sz, func(b *testing.B) {
				nonces := make([]byte, run*NonceSizeX)
				first := uint64(0)
				cputime.Loop(b, len(buf), func() {
					for i := range run {
						binary.LittleEndian.PutUint64(nonces[i*NonceSizeX:], first+uint64(i))
					}
					XORKeyStreamXMany(rounds, &key, nonces, buf, buf)
					first += run
				})
			})
			b.Run("XChaCha"+rs+"-each/"+sz, func(b *testing.B) {
				first := uint64(0)
				cputime.Loop(b, len(buf), func() {
					var nonce [NonceSizeX]byte
					for i := range run {
						binary.LittleEndian.PutUint64(nonce[:], first+uint64(i))
						XORKeyStreamXAt(rounds, &key, &nonce, 0, buf[i*size:(i+1)*size], buf[i*size:(i+1)*size])
					}
					first += run
				})
			})
		}
	}
}

// BenchmarkHChaChaMany is HChaCha20 for n nonces per op: one at a time ("one", the
// one-nonce kernel) and in batches on each engine. It is what the remainder rules in
// hchachaManyEngine were chosen from.
func BenchmarkHChaChaMany(b *testing.B) {
	var key [KeySize]byte
	var st [16]uint32
	initState(&st, &key)
	for _, n := range []int{1, 2, 4, 8, 9, 16} {
		nonces := make([]byte, n*HNonceSize)
		out := make([]byte, n*hSubkeySize)
		ns := strconv.Itoa(n)
		b.Run("one/"+ns, func(b *testing.B) {
			cputime.Loop(b, 0, func() {
				for i := 0; i < n; i++ {
					hchachaOneRef(&st, nonces[i*HNonceSize:], out[i*hSubkeySize:])
				}
			})
		})
		for _, e := range engines() {
			b.Run(e.String()+"/"+ns, func(b *testing.B) {
				cputime.Loop(b, 0, func() { hchachaManyEngine(e, &st, 20, nonces, out) })
			})
		}
	}
}

// hchachaOneRef is one HChaCha20 with the default engine's one-nonce kernel.
func hchachaOneRef(st *[16]uint32, nonce, out []byte) {
	s := *st
	setHNonce(&s, nonce)
	sub := hchacha(&s, 20)
	putSubkey(out, &sub)
}

// BenchmarkXAEADKeys: the subkeys and Poly1305 keys of n messages on each engine; n=1 is
// a lone random 4 KiB write's, which every engine derives with the scalar code.
func BenchmarkXAEADKeys(b *testing.B) {
	var key [KeySize]byte
	for _, n := range []int{1, 2, 4, 16} {
		nonces := make([]byte, n*NonceSizeX)
		sub := make([]byte, n*SubkeySize)
		pk := make([]byte, n*PolyKeySize)
		for _, e := range engines() {
			b.Run(e.String()+"/"+strconv.Itoa(n), func(b *testing.B) {
				cputime.Loop(b, 0, func() { xaeadKeys(e, &key, nonces, sub, pk) })
			})
		}
	}
}

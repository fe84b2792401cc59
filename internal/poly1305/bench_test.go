package poly1305

import (
	"fmt"
	"testing"

	"golang.org/x/crypto/poly1305"
)

// BenchmarkSumAEAD: SumAEAD with 42 bytes of additional data (what eli passes) on each
// path, beside x/crypto's Sum of the same MAC input built in advance ("xcrypto"), the
// baseline. Bytes are the ciphertext's.
func BenchmarkSumAEAD(b *testing.B) {
	for _, n := range []int{512, 4096, 65536} {
		ad := make([]byte, 42)
		ct := make([]byte, n)
		for i := range ct {
			ct[i] = byte(i)
		}
		var key [32]byte
		for i := range key {
			key[i] = byte(i * 7)
		}
		var tag [16]byte
		b.Run(fmt.Sprintf("xcrypto/%d", n), func(b *testing.B) {
			msg := macInput(ad, ct)
			b.SetBytes(int64(n))
			for b.Loop() {
				poly1305.Sum(&tag, msg, &key)
			}
		})
		for _, p := range paths() {
			b.Run(fmt.Sprintf("%v/%d", p, n), func(b *testing.B) {
				b.SetBytes(int64(n))
				for b.Loop() {
					sumAEAD(p, &tag, &key, ad, ct)
				}
			})
		}
	}
}

// BenchmarkSumAEADMany: sixteen sectors' tags, as a run of 4 KiB (or 512-byte) sectors
// needs them, with SumAEADMany and with SumAEAD one sector at a time on each path.
// Bytes are the ciphertext's.
func BenchmarkSumAEADMany(b *testing.B) {
	const n, adLen = 16, 42
	for _, size := range []int{512, 4096} {
		keys := make([]byte, 32*n)
		ads := make([]byte, adLen*n)
		cts := make([]byte, size*n)
		for i := range cts {
			cts[i] = byte(i)
		}
		for i := range keys {
			keys[i] = byte(i * 7)
		}
		tags := make([]byte, 16*n)
		for _, p := range paths() {
			b.Run(fmt.Sprintf("%v/many/%d", p, size), func(b *testing.B) {
				b.SetBytes(int64(n * size))
				for b.Loop() {
					sumAEADMany(p, tags, keys, ads, adLen, cts, size)
				}
			})
			b.Run(fmt.Sprintf("%v/one-by-one/%d", p, size), func(b *testing.B) {
				b.SetBytes(int64(n * size))
				for b.Loop() {
					sumAEADManyOneByOne(p, tags, keys, ads, adLen, cts, size)
				}
			})
		}
	}
}

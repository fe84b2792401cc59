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

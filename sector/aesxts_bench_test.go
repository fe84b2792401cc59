package sector

import (
	"crypto/aes"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/elidisk/eli/internal/aesxts"
	"github.com/elidisk/eli/internal/cputime"
	"golang.org/x/crypto/xts"
)

// BenchmarkAESXTS measures the aes-xts and aes128-xts codecs beside golang.org/x/crypto/xts
// (what they used before package aesxts), at 512 and 4096 bytes per sector: "seal" is one
// Seal per op at a new index, "run" one SealRun of 64 KiB per op (blockdev's chunk);
// "xcrypto-seal" and "xcrypto-run" do the same work with xts.Cipher.Encrypt. Compare
// cpu-ns/op of each pair; the codecs' implementation is in the name (aesxts.Implementation).
func BenchmarkAESXTS(b *testing.B) {
	const runBytes = 64 << 10
	r := rand.New(rand.NewPCG(3, 3))
	impl := aesxts.Implementation()
	for _, m := range []Mode{ModeAESXTS256, ModeAESXTS128} {
		key := seededKey(r, m)
		ref, err := xts.NewCipher(aes.NewCipher, key)
		if err != nil {
			b.Fatal(err)
		}
		for _, size := range []int{512, 4096} {
			c := newLPCodec(b, m, size, key)
			n := runBytes / size
			name := func(what string) string { return m.String() + "/" + what + "/" + strconv.Itoa(size) }
			b.Run(name("seal-"+impl), func(b *testing.B) {
				buf := make([]byte, size)
				index := uint64(0)
				cputime.Loop(b, size, func() { c.Seal(index, buf, nil); index++ })
			})
			b.Run(name("xcrypto-seal"), func(b *testing.B) {
				buf := make([]byte, size)
				index := uint64(0)
				cputime.Loop(b, size, func() { ref.Encrypt(buf, buf, index); index++ })
			})
			b.Run(name("run-"+impl), func(b *testing.B) {
				buf := make([]byte, runBytes)
				first := uint64(0)
				cputime.Loop(b, runBytes, func() { c.(Runner).SealRun(first, buf, buf); first += uint64(n) })
			})
			b.Run(name("xcrypto-run"), func(b *testing.B) {
				buf := make([]byte, runBytes)
				first := uint64(0)
				cputime.Loop(b, runBytes, func() {
					for k := range n {
						ref.Encrypt(buf[k*size:(k+1)*size], buf[k*size:(k+1)*size], first+uint64(k))
					}
					first += uint64(n)
				})
			})
		}
	}
}

package sector

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/elidisk/eli/internal/cputime"
)

// BenchmarkSealRun seals one 64 KiB run per op (blockdev's parallel chunk: 16 sectors of
// 4 KiB, 128 of 512 B) at advancing indexes, for every length-preserving mode side by
// side, and for xchacha20-xts also sector by sector with Seal ("xchacha20-xts-each", an
// HChaCha per sector, which runs save). Compare xchacha20-xts with chacha20-xts at
// the same sector size in cpu-ns/op: the target is within 10% at 4 KiB.
func BenchmarkSealRun(b *testing.B) {
	const runBytes = 64 << 10
	r := rand.New(rand.NewPCG(2, 2))
	for _, size := range []int{4096, 512} {
		n := runBytes / size
		for _, m := range lengthPreserving() {
			c := newLPCodec(b, m, size, seededKey(r, m))
			b.Run(m.String()+"/"+strconv.Itoa(size), func(b *testing.B) {
				buf := make([]byte, runBytes)
				run := c.(Runner)
				first := uint64(0)
				cputime.Loop(b, runBytes, func() {
					run.SealRun(first, buf, buf)
					first += uint64(n)
				})
			})
			if m != ModeXChaCha20XTS {
				continue
			}
			b.Run(m.String()+"-each/"+strconv.Itoa(size), func(b *testing.B) {
				buf := make([]byte, runBytes)
				first := uint64(0)
				cputime.Loop(b, runBytes, func() {
					for k := range n {
						c.Seal(first+uint64(k), buf[k*size:(k+1)*size], nil)
					}
					first += uint64(n)
				})
			})
		}
	}
}

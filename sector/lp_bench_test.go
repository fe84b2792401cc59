package sector

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/elidisk/eli/internal/cputime"
)

// BenchmarkLengthPreserving seals one sector per op, each at a new index (the unsafe
// XChaCha modes pay an HChaCha per sector, as they would on a disk), for every
// length-preserving mode side by side; none is the floor.
func BenchmarkLengthPreserving(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, size := range []int{512, 4096} {
		for _, m := range lengthPreserving() {
			b.Run(m.String()+"/"+strconv.Itoa(size), func(b *testing.B) {
				c := newLPCodec(b, m, size, seededKey(r, m))
				buf := make([]byte, size)
				b.SetBytes(int64(size))
				b.ReportAllocs()
				index := uint64(0)
				start := cputime.Process()
				for b.Loop() {
					c.Seal(index, buf, nil)
					index++
				}
				// CPU time beside wall time: on a shared machine wall time includes time
				// spent descheduled.
				if cpu := cputime.Process() - start; cpu > 0 {
					ns := float64(cpu.Nanoseconds()) / float64(b.N)
					b.ReportMetric(ns, "cpu-ns/op")
					b.ReportMetric(float64(size)/ns*1e3, "cpu-MB/s")
				}
			})
		}
	}
}

package nbdclient

import (
	"math/bits"
	"sync"
)

// Copies of writes kept for replay come from pools by power-of-two size, so that a
// stream of writes reuses a few buffers instead of allocating (and zeroing and faulting
// in) a new one each time, which costs sequential writes much of their throughput
// (BenchmarkRemoteVsDirect; docs/benchmarks.md, "Measurements behind design choices").
const (
	minPoolShift = 12 // 4 KiB
	maxPoolShift = 25 // 32 MiB (MaxRequest)
)

var bufPools [maxPoolShift - minPoolShift + 1]sync.Pool

func poolClass(n int) int {
	if n <= 1<<minPoolShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minPoolShift
}

// getCopy returns a pooled copy of p.
func getCopy(p []byte) []byte {
	c := poolClass(len(p))
	if c >= len(bufPools) {
		return append([]byte(nil), p...)
	}
	var b []byte
	if v, ok := bufPools[c].Get().(*[]byte); ok {
		b = (*v)[:len(p)]
	} else {
		b = make([]byte, len(p), 1<<(c+minPoolShift))
	}
	copy(b, p)
	return b
}

// putCopy returns a buffer from getCopy to its pool.
func putCopy(b []byte) {
	if b == nil {
		return
	}
	c := poolClass(cap(b))
	if c >= len(bufPools) || cap(b) != 1<<(c+minPoolShift) {
		return
	}
	bufPools[c].Put(&b)
}

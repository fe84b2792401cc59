package nbd

import (
	"math/bits"
	"sync"
)

// Payload buffers are pooled by power-of-two size class, from 4 KiB up to MaxRequest, so
// that the hot path (a read or write of the same size over and over) allocates nothing.
const (
	minClassShift = 12
	maxClassShift = 26 // MaxRequest
	numClasses    = maxClassShift - minClassShift + 1
)

var bufPools [numClasses]sync.Pool

func classOf(n int) int {
	if n <= 1<<minClassShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minClassShift
}

// getBuf returns a buffer of length n (0 < n <= MaxRequest); its contents are garbage.
func getBuf(n int) *[]byte {
	c := classOf(n)
	if p, ok := bufPools[c].Get().(*[]byte); ok {
		*p = (*p)[:n]
		return p
	}
	b := make([]byte, n, 1<<(c+minClassShift))
	return &b
}

func putBuf(p *[]byte) {
	c := classOf(cap(*p))
	if cap(*p) != 1<<(c+minClassShift) {
		return // not one of ours
	}
	bufPools[c].Put(p)
}

package blockdev

import "sync"

// stripeCount is the number of sector locks. A sector uses lock index mod stripeCount, so
// a request locks a contiguous (possibly wrapping) run of stripes, always in ascending
// order, which rules out deadlock between requests.
const stripeCount = 1024

// stripes serialise the writes of one sector: a read-modify-write holds its sector's lock
// from the read to the insert of the new value, and every other write takes the same lock
// to insert, so no write can land between the two halves and be lost.
type stripes [stripeCount]sync.Mutex

func (s *stripes) lock(first, n uint64) {
	if n >= stripeCount {
		for i := range s {
			s[i].Lock()
		}
		return
	}
	a, b := first%stripeCount, (first+n-1)%stripeCount
	if a <= b {
		for i := a; i <= b; i++ {
			s[i].Lock()
		}
		return
	}
	for i := uint64(0); i <= b; i++ {
		s[i].Lock()
	}
	for i := a; i < stripeCount; i++ {
		s[i].Lock()
	}
}

func (s *stripes) unlock(first, n uint64) {
	if n >= stripeCount {
		for i := range s {
			s[i].Unlock()
		}
		return
	}
	for k := range n {
		s[(first+k)%stripeCount].Unlock()
	}
}

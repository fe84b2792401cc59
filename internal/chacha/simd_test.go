package chacha

import (
	"bytes"
	"math/rand/v2"
	"strconv"
	"testing"
)

const guard = 64 // canary bytes on each side of every output

// TestSIMDAgainstGeneric runs each SIMD engine against the generic code for every
// length 0..1100, at every offset 0..63 of source and destination (in place and not),
// for every round count and both counter layouts, and checks that nothing outside the
// output is written.
func TestSIMDAgainstGeneric(t *testing.T) {
	t.Parallel()
	es := engines()[1:]
	if len(es) == 0 {
		t.Skip("no SIMD engine on this machine or build (generic only)")
	}
	const maxLen = 1100
	for _, e := range es {
		for _, rounds := range []int{8, 12, 20} {
			for _, ctr64 := range []bool{false, true} {
				name := e.String() + "/" + strconv.Itoa(rounds)
				if ctr64 {
					name += "/ctr64"
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					r := rand.New(rand.NewPCG(uint64(rounds), uint64(e)))
					var st [16]uint32
					for i := range st {
						st[i] = r.Uint32()
					}
					src := make([]byte, maxLen)
					fill(r, src)
					// The keystream does not depend on the length: one reference serves all.
					want := make([]byte, maxLen)
					xorGeneric(&st, rounds, ctr64, want, src)

					// Every output lands in buf, which is reset from pattern before each call, so
					// any byte written outside the output shows up as a change from pattern.
					size := 2*guard + maxLen + 64
					pattern, buf, in := make([]byte, size), make([]byte, size), make([]byte, size)
					fill(r, pattern)
					for n := 0; n <= maxLen; n++ {
						for off := 0; off < 64; off++ {
							// Out of place: src at off, dst at 63-off.
							copy(buf, pattern)
							copy(in[guard+off:], src[:n])
							at := guard + 63 - off
							xorKeyStream(e, &st, rounds, ctr64, buf[at:at+n], in[guard+off:guard+off+n])
							checkOut(t, e, n, off, "out of place", buf, pattern, at, want)

							// In place at off.
							copy(buf, pattern)
							at = guard + off
							copy(buf[at:], src[:n])
							xorKeyStream(e, &st, rounds, ctr64, buf[at:at+n], buf[at:at+n])
							checkOut(t, e, n, off, "in place", buf, pattern, at, want)
						}
					}
				})
			}
		}
	}
}

func checkOut(t *testing.T, e engine, n, off int, how string, buf, pattern []byte, at int, want []byte) {
	t.Helper()
	if !bytes.Equal(buf[at:at+n], want[:n]) {
		t.Fatalf("%v len %d offset %d %s: first difference at %d", e, n, off, how, firstDiff(buf[at:at+n], want))
	}
	if !bytes.Equal(buf[:at], pattern[:at]) || !bytes.Equal(buf[at+n:], pattern[at+n:]) {
		t.Fatalf("%v len %d offset %d %s: wrote outside the output", e, n, off, how)
	}
}

// TestSIMDLong covers the multi-chunk loops with start counters that put a chunk start
// or a lane exactly on 0 and on the 2^32 boundary, where the lane carry and the carry
// between chunks matter (64-bit layout) or must stay out of the nonce (RFC layout).
func TestSIMDLong(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(7, 7))
	lengths := []int{512, 1024, 1536, 2048, 4096, 4096 + 512 + 64 + 1, 65536 + 100}
	starts := []uint64{0, 1, 1<<32 - 1, 1<<32 - 8, 1<<32 - 16, 1<<32 - 24, 1<<32 - 37, 0xfff0_0000}
	for _, e := range engines()[1:] {
		for _, ctr64 := range []bool{false, true} {
			for _, start := range starts {
				var st [16]uint32
				for i := range st {
					st[i] = r.Uint32()
				}
				st[12] = uint32(start)
				for _, n := range lengths {
					blocks := uint64(n+BlockSize-1) / BlockSize
					if !ctr64 && start+blocks > 1<<32 {
						continue // past the end of a 32-bit counter: callers never ask
					}
					src := make([]byte, n)
					fill(r, src)
					want, got := make([]byte, n), make([]byte, n)
					xorGeneric(&st, 20, ctr64, want, src)
					xorKeyStream(e, &st, 20, ctr64, got, src)
					if !bytes.Equal(got, want) {
						t.Fatalf("%v ctr64=%v start %#x len %d: first difference at %d", e, ctr64, start, n, firstDiff(got, want))
					}
				}
			}
		}
	}
}

// TestHChaChaEngines compares each engine's HChaCha with the generic one.
func TestHChaChaEngines(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(8, 9))
	for i := 0; i < 500; i++ {
		var st [16]uint32
		for j := range st {
			st[j] = r.Uint32()
		}
		for _, rounds := range []int{8, 12, 20} {
			want := hchachaGeneric(&st, rounds)
			for _, e := range engines()[1:] {
				if got := hchachaEngine(e, &st, rounds); got != want {
					t.Fatalf("%v, %d rounds: got %08x want %08x", e, rounds, got, want)
				}
			}
		}
	}
}

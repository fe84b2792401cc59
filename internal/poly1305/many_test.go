package poly1305

import (
	"fmt"
	"math/rand"
	"testing"

	"golang.org/x/crypto/poly1305"
)

// checkManyPaths compares every path's SumAEADMany with x/crypto's Sum of each message's
// explicit MAC input.
func checkManyPaths(t *testing.T, what string, keys, ads []byte, adLen int, cts []byte, ctLen int) {
	t.Helper()
	n := len(keys) / 32
	for _, p := range paths() {
		tags := make([]byte, 16*n)
		sumAEADMany(p, tags, keys, ads, adLen, cts, ctLen)
		for i := range n {
			var want [16]byte
			poly1305.Sum(&want, macInput(ads[adLen*i:adLen*(i+1)], cts[ctLen*i:ctLen*(i+1)]), (*[32]byte)(keys[32*i:]))
			if got := tags[16*i : 16*i+16]; string(got) != string(want[:]) {
				t.Fatalf("%v, %s, len(ad) %d, len(ct) %d: message %d tag %x, x/crypto %x", p, what, adLen, ctLen, i, got, want)
			}
		}
	}
}

// TestSumAEADManyMatchesXCrypto: every path's SumAEADMany against x/crypto's Sum of each
// message's explicit MAC input, for message counts around the kernels' groups of 8 and
// 16, ad lengths on both sides of their 64-byte limit, and ct lengths that are whole
// blocks (the kernels) or not (one by one). The messages sit back to back in one
// buffer, as a run of sectors does.
func TestSumAEADManyMatchesXCrypto(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewSource(7))
	for _, n := range []int{0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 40} {
		for _, adLen := range []int{0, 1, 16, 42, 64, 65} {
			for _, ctLen := range []int{0, 16, 48, 100, 512, 4096} {
				keys := make([]byte, 32*n)
				ads := make([]byte, adLen*n)
				cts := make([]byte, ctLen*n)
				rng.Read(keys)
				rng.Read(ads)
				rng.Read(cts)
				checkManyPaths(t, fmt.Sprintf("%d messages", n), keys, ads, adLen, cts, ctLen)
			}
		}
	}
}

// TestSumAEADManyExtremes: limbs at their largest (every key bit that the clamp keeps,
// all-ones data) and at zero, where a carry or a lane mix-up would show.
func TestSumAEADManyExtremes(t *testing.T) {
	t.Parallel()
	const n, adLen, ctLen = 16, 42, 4096
	for _, fill := range []byte{0x00, 0xff} {
		keys := make([]byte, 32*n)
		ads := make([]byte, adLen*n)
		cts := make([]byte, ctLen*n)
		for i := range keys {
			keys[i] = fill
		}
		for i := range ads {
			ads[i] = fill
		}
		for i := range cts {
			cts[i] = fill
		}
		keys[32*5] ^= 1 // one message differs, to catch lanes swapped
		checkManyPaths(t, fmt.Sprintf("fill %#x", fill), keys, ads, adLen, cts, ctLen)
	}
}

func TestSumAEADManyBadLengths(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		tags, keys, ads, cts int
		adLen, ctLen         int
	}{
		{"tags not whole", 17, 32, 0, 0, 0, 0},
		{"keys short", 32, 32, 0, 0, 0, 0},
		{"ads short", 16, 32, 3, 0, 4, 0},
		{"cts long", 16, 32, 0, 17, 0, 16},
		{"negative length", 16, 32, 0, 0, -1, 0},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", tc.name)
				}
			}()
			SumAEADMany(make([]byte, tc.tags), make([]byte, tc.keys), make([]byte, tc.ads), tc.adLen, make([]byte, tc.cts), tc.ctLen)
		}()
	}
}

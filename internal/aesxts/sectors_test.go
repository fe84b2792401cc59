package aesxts

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestSectorsAgainstXCrypto: EncryptSectors and DecryptSectors on every engine give
// what golang.org/x/crypto/xts gives unit by unit, for units that are and are not whole
// steps of the kernels' loops, runs of 1 to 21 units (so each kernel carries a
// precomputed tweak from unit to unit, across the 2^64 wrap of the unit number), in
// place and out of place at misaligned offsets, writing nothing outside the output.
func TestSectorsAgainstXCrypto(t *testing.T) {
	t.Parallel()
	units := []int{16, 48, 128, 144, 256, 272, 512, 4096}
	for _, e := range engines() {
		for _, keySize := range []int{32, 64} {
			t.Run(fmt.Sprintf("%v/%d", e, keySize), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(e)+10, uint64(keySize)))
				key := make([]byte, keySize)
				fill(r, key)
				c, ref := mustCipher(t, key, e), refCipher(t, key)
				for _, unit := range units {
					for count := 1; count <= 21; count++ {
						first := r.Uint64()
						if count%3 == 0 {
							first = ^uint64(0) - uint64(count/2) // wraps mid-run
						}
						checkSectors(t, r, c, ref, unit, count, first)
					}
				}
			})
		}
	}
}

func checkSectors(t *testing.T, r *rand.Rand, c *Cipher, ref interface {
	Encrypt(dst, src []byte, index uint64)
}, unit, count int, first uint64) {
	t.Helper()
	n := unit * count
	plain := make([]byte, n)
	fill(r, plain)
	want := make([]byte, n)
	for k := range count {
		ref.Encrypt(want[k*unit:(k+1)*unit], plain[k*unit:(k+1)*unit], first+uint64(k))
	}
	size := 2*guard + n + 64
	pattern, buf, in := make([]byte, size), make([]byte, size), make([]byte, size)
	fill(r, pattern)
	srcOff, dstOff := guard+r.IntN(64), guard+r.IntN(64)
	for _, dec := range []bool{false, true} {
		from, to, op := plain, want, c.EncryptSectors
		if dec {
			from, to, op = want, plain, c.DecryptSectors
		}
		what := fmt.Sprintf("%v %d-round unit %d count %d first %#x dec=%v", c.e, c.rounds, unit, count, first, dec)
		copy(buf, pattern)
		copy(in[srcOff:], from)
		op(buf[dstOff:dstOff+n], in[srcOff:srcOff+n], unit, first)
		if !bytes.Equal(buf[dstOff:dstOff+n], to) {
			t.Fatalf("%s out of place: differs from x/crypto/xts at byte %d", what, firstDiff(buf[dstOff:dstOff+n], to))
		}
		if !bytes.Equal(buf[:dstOff], pattern[:dstOff]) || !bytes.Equal(buf[dstOff+n:], pattern[dstOff+n:]) {
			t.Fatalf("%s out of place: wrote outside the output", what)
		}
		copy(buf, pattern)
		copy(buf[srcOff:], from)
		op(buf[srcOff:srcOff+n], buf[srcOff:srcOff+n], unit, first)
		if !bytes.Equal(buf[srcOff:srcOff+n], to) {
			t.Fatalf("%s in place: differs from x/crypto/xts at byte %d", what, firstDiff(buf[srcOff:srcOff+n], to))
		}
		if !bytes.Equal(buf[:srcOff], pattern[:srcOff]) || !bytes.Equal(buf[srcOff+n:], pattern[srcOff+n:]) {
			t.Fatalf("%s in place: wrote outside the output", what)
		}
	}
}

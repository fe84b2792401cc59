package aesxts

import (
	"bytes"
	"crypto/aes"
	"fmt"
	"math/rand/v2"
	"testing"

	"golang.org/x/crypto/xts"
)

const guard = 64 // canary bytes on each side of every output

func fill(r *rand.Rand, b []byte) {
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func refCipher(t testing.TB, key []byte) *xts.Cipher {
	t.Helper()
	ref, err := xts.NewCipher(aes.NewCipher, key)
	if err != nil {
		t.Fatal(err)
	}
	return ref
}

func mustCipher(t testing.TB, key []byte, e engine) *Cipher {
	t.Helper()
	c, err := newCipher(key, e)
	if err != nil {
		t.Fatalf("newCipher(%d-byte key, %v): %v", len(key), e, err)
	}
	return c
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// testIndexes are the data unit numbers every length is tried at: the ends of the 32-
// and 64-bit ranges and a few in between (the tweak block's high half stays zero).
var testIndexes = []uint64{0, 1, 0xff, 1<<32 - 1, 1 << 32, 0x0123456789abcdef, 1<<63 + 5, 1<<64 - 2, 1<<64 - 1}

// TestEnginesAgainstXCrypto runs every engine against golang.org/x/crypto/xts, forced
// one by one, on random AES-128 and AES-256 keys: every length from 16 to 1104 bytes (all
// tails of the 8- and 16-block loops) and the sector sizes 2048..65536, at every index of
// testIndexes for the sector sizes and one per length otherwise, encrypting and
// decrypting, in place and out of place, at source and destination offsets that break
// every alignment, and checks that nothing outside the output is written.
func TestEnginesAgainstXCrypto(t *testing.T) {
	t.Parallel()
	lengths := []int{2048, 4096, 8192, 16384, 32768, 65536}
	for n := 16; n <= 1104; n += 16 {
		lengths = append(lengths, n)
	}
	for _, e := range engines() {
		for _, keySize := range []int{32, 64} {
			t.Run(fmt.Sprintf("%v/%d", e, keySize), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(e), uint64(keySize)))
				for _, n := range lengths {
					key := make([]byte, keySize)
					fill(r, key)
					c, ref := mustCipher(t, key, e), refCipher(t, key)
					indexes := testIndexes
					if n <= 1104 && n != 512 && n != 1024 {
						indexes = []uint64{r.Uint64() >> r.IntN(64)}
					}
					for _, index := range indexes {
						checkEngine(t, r, c, ref, n, index)
					}
				}
			})
		}
	}
}

// checkEngine compares c with ref on one random n-byte unit at index, both directions,
// in place and out of place, at a random pair of misaligned offsets.
func checkEngine(t *testing.T, r *rand.Rand, c *Cipher, ref *xts.Cipher, n int, index uint64) {
	t.Helper()
	plain := make([]byte, n)
	fill(r, plain)
	want := make([]byte, n)
	ref.Encrypt(want, plain, index)

	size := 2*guard + n + 64
	pattern, buf, in := make([]byte, size), make([]byte, size), make([]byte, size)
	fill(r, pattern)
	srcOff, dstOff := guard+r.IntN(64), guard+r.IntN(64)
	for _, dec := range []bool{false, true} {
		from, to, op := plain, want, c.Encrypt
		if dec {
			from, to, op = want, plain, c.Decrypt
		}
		// Out of place.
		copy(buf, pattern)
		copy(in[srcOff:], from)
		op(buf[dstOff:dstOff+n], in[srcOff:srcOff+n], index)
		checkOut(t, c, n, index, dec, "out of place", buf, pattern, dstOff, to)
		if !bytes.Equal(in[srcOff:srcOff+n], from) {
			t.Fatalf("%v %d bytes index %#x dec=%v: the input changed", c.e, n, index, dec)
		}
		// In place.
		copy(buf, pattern)
		copy(buf[srcOff:], from)
		op(buf[srcOff:srcOff+n], buf[srcOff:srcOff+n], index)
		checkOut(t, c, n, index, dec, "in place", buf, pattern, srcOff, to)
	}
}

func checkOut(t *testing.T, c *Cipher, n int, index uint64, dec bool, how string, buf, pattern []byte, at int, want []byte) {
	t.Helper()
	if !bytes.Equal(buf[at:at+n], want) {
		t.Fatalf("%v %d-round %d bytes index %#x dec=%v %s: differs from x/crypto/xts at byte %d",
			c.e, c.rounds, n, index, dec, how, firstDiff(buf[at:at+n], want))
	}
	if !bytes.Equal(buf[:at], pattern[:at]) || !bytes.Equal(buf[at+n:], pattern[at+n:]) {
		t.Fatalf("%v %d bytes index %#x dec=%v %s: wrote outside the output", c.e, n, index, dec, how)
	}
}

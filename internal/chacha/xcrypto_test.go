package chacha

import (
	"bytes"
	"math/rand/v2"
	"strconv"
	"testing"

	"golang.org/x/crypto/chacha20"
)

// split cuts n into 1 to 5 random pieces (some possibly empty) that add up to n.
func split(r *rand.Rand, n int) []int {
	k := 1 + r.IntN(5)
	cuts := make([]int, 0, k+1)
	cuts = append(cuts, 0)
	for i := 1; i < k; i++ {
		cuts = append(cuts, r.IntN(n+1))
	}
	cuts = append(cuts, n)
	for i := 1; i < len(cuts); i++ { // insertion sort: k is tiny
		for j := i; j > 0 && cuts[j] < cuts[j-1]; j-- {
			cuts[j], cuts[j-1] = cuts[j-1], cuts[j]
		}
	}
	pieces := make([]int, 0, k)
	for i := 1; i < len(cuts); i++ {
		pieces = append(pieces, cuts[i]-cuts[i-1])
	}
	return pieces
}

// TestAgainstXCrypto compares ChaCha20 and XChaCha20 with golang.org/x/crypto/chacha20
// for every length 0..4160 on random keys, nonces and counters, feeding each engine
// the input in random pieces.
func TestAgainstXCrypto(t *testing.T) {
	t.Parallel()
	for _, nonceSize := range []int{NonceSize, NonceSizeX} {
		for _, e := range engines() {
			t.Run(e.String()+"/nonce"+strconv.Itoa(nonceSize), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(nonceSize), uint64(e)))
				key, nonce := make([]byte, KeySize), make([]byte, nonceSize)
				src := make([]byte, 4160)
				for n := 0; n <= 4160; n++ {
					fill(r, key)
					fill(r, nonce)
					fill(r, src[:n])
					ctr := r.Uint32() >> r.IntN(33) // small and large counters alike
					if ctr > 1<<32-1-100 {
						ctr -= 100
					}
					ref, err := chacha20.NewUnauthenticatedCipher(key, nonce)
					if err != nil {
						t.Fatal(err)
					}
					ref.SetCounter(ctr)
					want := make([]byte, n)
					ref.XORKeyStream(want, src[:n])

					c := newCipher(t, 20, key, nonce)
					c.eng = e
					c.SetCounter(uint64(ctr))
					got := make([]byte, n)
					off := 0
					for _, p := range split(r, n) {
						c.XORKeyStream(got[off:off+p], src[off:off+p])
						off += p
					}
					if !bytes.Equal(got, want) {
						t.Fatalf("len %d counter %d: first difference at byte %d", n, ctr, firstDiff(got, want))
					}
				}
			})
		}
	}
}

func TestHChaChaAgainstXCrypto(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	key, nonce := make([]byte, 32), make([]byte, 16)
	for i := 0; i < 200; i++ {
		fill(r, key)
		fill(r, nonce)
		want, err := chacha20.HChaCha20(key, nonce)
		if err != nil {
			t.Fatal(err)
		}
		got, err := HChaCha(20, key, nonce)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[:], want) {
			t.Fatalf("key %x nonce %x: got %x want %x", key, nonce, got, want)
		}
	}
}

func fill(r *rand.Rand, b []byte) {
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

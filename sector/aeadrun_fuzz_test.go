package sector

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"

	"golang.org/x/crypto/chacha20poly1305"
)

// FuzzRunMeta seals a run with the codec on every path this machine has, checks each
// sector against x/crypto's XChaCha20-Poly1305 under the nonce in its record, opens it
// back, and flips one bit of one sector or record, which must fail that sector alone.
// The fuzzer picks the run length, the sector size, the first index (wrapping past
// 2^64−1 included), whether it works in place, and the bytes.
func FuzzRunMeta(f *testing.F) {
	f.Add(uint8(1), false, uint64(0), false, uint64(1), uint16(0))
	f.Add(uint8(17), true, ^uint64(0)-3, true, uint64(2), uint16(77))
	f.Add(uint8(40), false, uint64(1)<<40, false, uint64(3), uint16(9999))
	ref, err := chacha20poly1305.NewX(testKey)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, n8 uint8, big bool, first uint64, inPlace bool, seed uint64, flip uint16) {
		n := int(n8%40) + 1
		size := 512
		if big {
			size = 4096
		}
		r := rand.New(rand.NewPCG(seed, uint64(n)))
		plain := make([]byte, n*size)
		for i := range plain {
			plain[i] = byte(r.Uint32())
		}
		for name, c := range aeadPaths(t, size) {
			src := bytes.Clone(plain)
			dst := make([]byte, len(src))
			if inPlace {
				dst = src
			}
			meta := make([]byte, n*aeadMetaSize)
			c.SealRunMeta(first, dst, src, meta)
			for k := range n {
				rec := meta[k*aeadMetaSize : (k+1)*aeadMetaSize]
				sealed := append(bytes.Clone(dst[k*size:(k+1)*size]), rec[aeadNonceSize:]...)
				got, err := ref.Open(nil, rec[:aeadNonceSize], sealed, specAD(testVol, 1, uint32(size), first+uint64(k)))
				if err != nil || !bytes.Equal(got, plain[k*size:(k+1)*size]) {
					t.Fatalf("%s: sector %d of %d does not open with x/crypto (%v)", name, k, n, err)
				}
			}
			// One bit of one sector's data or record.
			bit := int(flip) % ((size + aeadMetaSize) * 8)
			victim := int(flip) % n
			sealed, recs := bytes.Clone(dst), bytes.Clone(meta)
			if bit < size*8 {
				sealed[victim*size+bit/8] ^= 1 << (bit % 8)
			} else {
				b := bit - size*8
				recs[victim*aeadMetaSize+b/8] ^= 1 << (b % 8)
			}
			out := make([]byte, len(sealed))
			err := c.OpenRunMeta(first, out, sealed, recs)
			var bad *RunAuthError
			if !errors.As(err, &bad) || len(bad.Sectors) != 1 || bad.Sectors[0] != first+uint64(victim) {
				t.Fatalf("%s: flipped bit %d of sector %d, got %v", name, bit, victim, err)
			}
			for k := range n {
				want := plain[k*size : (k+1)*size]
				if k == victim {
					want = make([]byte, size)
				}
				if !bytes.Equal(out[k*size:(k+1)*size], want) {
					t.Fatalf("%s: sector %d after the flip in sector %d", name, k, victim)
				}
			}
		}
	})
}

//go:build amd64 && !purego

package poly1305

import (
	"math/big"
	"testing"

	"golang.org/x/crypto/poly1305"
)

// sumRaw is Poly1305 of a raw message (RFC 8439 §2.5) with path p, for the RFC's
// vectors, which are not all AEAD inputs. The IFMA path runs the kernel over the
// message as whole blocks, the last one padded with 0x01 and zeros as §2.5.1 says; the
// kernel gives that block the 2^128 bit every block of the AEAD input has, which a
// partial final block does not, so 2^128·r (its term in the Horner sum) is taken off
// again here before the final reduction.
func sumRaw(p path, tag *[16]byte, key *[32]byte, msg []byte) {
	if p != pathIFMA {
		poly1305.Sum(tag, msg, key)
		return
	}
	if len(msg) == 0 {
		finish(tag, key, 0, 0, 0)
		return
	}
	m := msg
	partial := len(msg)%16 != 0
	if partial {
		m = append(append([]byte{}, msg...), 1)
	}
	buf := make([]byte, 512)
	h0, h1, h2 := hashIFMA(buf, key, nil, m, false)
	if partial {
		pmod := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 130), big.NewInt(5))
		h := new(big.Int).SetUint64(h2)
		h.Lsh(h, 64).Add(h, new(big.Int).SetUint64(h1))
		h.Lsh(h, 64).Add(h, new(big.Int).SetUint64(h0))
		r := new(big.Int).SetBytes(reverse(key[:16]))
		r.And(r, new(big.Int).SetBytes(reverse(clampMask)))
		h.Sub(h, r.Lsh(r, 128)).Mod(h, pmod)
		w := h.FillBytes(make([]byte, 24)) // big-endian h2, h1, h0
		word := func(b []byte) uint64 {
			var v uint64
			for _, x := range b {
				v = v<<8 | uint64(x)
			}
			return v
		}
		h2, h1, h0 = word(w[0:8]), word(w[8:16]), word(w[16:24])
	}
	finish(tag, key, h0, h1, h2)
}

// clampMask is RFC 8439 §2.5.1's clamp of r, as little-endian bytes.
var clampMask = []byte{
	0xff, 0xff, 0xff, 0x0f, 0xfc, 0xff, 0xff, 0x0f,
	0xfc, 0xff, 0xff, 0x0f, 0xfc, 0xff, 0xff, 0x0f,
}

func reverse(b []byte) []byte {
	r := make([]byte, len(b))
	for i, x := range b {
		r[len(b)-1-i] = x
	}
	return r
}

// TestLaneTables: lanesBelow and laneOf agree on the kernel's block order.
func TestLaneTables(t *testing.T) {
	for n := 0; n <= 8; n++ {
		var m uint64
		for b := 0; b < n; b++ {
			m |= 1 << laneOf(b)
		}
		if lanesBelow[n] != m {
			t.Errorf("lanesBelow[%d] = %#x, want %#x", n, lanesBelow[n], m)
		}
	}
}

package sector

import (
	"bytes"
	"crypto/aes"
	"fmt"
	"math/rand/v2"
	"testing"

	"golang.org/x/crypto/xts"
)

// TestAESXTSAgainstXCrypto pins aes-xts and aes128-xts, through every entry point
// (Seal, Open, SealRun, OpenRun), to golang.org/x/crypto/xts over crypto/aes
// with the sector index as data unit number: every sector size, indexes near both ends
// of the 64-bit range, runs that wrap past 2^64−1, buffers at odd offsets. aesxts tests
// each of its implementations against x/crypto/xts; this checks the codec's wiring.
func TestAESXTSAgainstXCrypto(t *testing.T) {
	t.Parallel()
	for _, m := range []Mode{ModeAESXTS256, ModeAESXTS128} {
		for size := MinSectorSize; size <= MaxSectorSize; size *= 2 {
			t.Run(fmt.Sprintf("%s/%d", m, size), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(m), uint64(size)+77))
				key := seededKey(r, m)
				c := newLPCodec(t, m, size, key)
				ref, err := xts.NewCipher(aes.NewCipher, key)
				if err != nil {
					t.Fatal(err)
				}
				const n = 3 // sectors per run
				for _, first := range []uint64{0, 1 << 32, r.Uint64(), 1<<64 - 2} {
					off := 1 + r.IntN(63)
					p := append(make([]byte, off), seededBytes(r, n*size)...)[off:]
					want := make([]byte, n*size)
					for k := range n {
						ref.Encrypt(want[k*size:(k+1)*size], p[k*size:(k+1)*size], first+uint64(k))
					}
					one := bytes.Clone(p[:size])
					c.Seal(first, one, nil)
					if !bytes.Equal(one, want[:size]) {
						t.Fatalf("index %#x: Seal differs from x/crypto/xts at byte %d", first, diffAt(one, want))
					}
					to := make([]byte, size+1)[1:]
					c.(Runner).SealRun(first+1, to, p[size:2*size])
					if !bytes.Equal(to, want[size:2*size]) {
						t.Fatalf("index %#x: a one-sector SealRun out of place differs from x/crypto/xts at byte %d", first+1, diffAt(to, want[size:]))
					}
					if err := c.Open(first, one, nil); err != nil || !bytes.Equal(one, p[:size]) {
						t.Fatalf("index %#x: Open: %v, plaintext restored %v", first, err, bytes.Equal(one, p[:size]))
					}
					run := make([]byte, n*size+off)[off:]
					c.(Runner).SealRun(first, run, p)
					if !bytes.Equal(run, want) {
						t.Fatalf("first %#x: SealRun differs from x/crypto/xts at byte %d", first, diffAt(run, want))
					}
					if err := c.(Runner).OpenRun(first, run, run); err != nil || !bytes.Equal(run, p) {
						t.Fatalf("first %#x: OpenRun: %v, plaintext restored %v", first, err, bytes.Equal(run, p))
					}
				}
			})
		}
	}
}

package blockdev

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

// TestWriteKeep: writes through WriteKeep, whose buffers the batch keeps and seals in
// place, mixed with WriteAt, read back as written; each buffer is handed back exactly
// once, by the time a Flush returns (nothing else holds it then); and a buffer given
// to a length-preserving mode, or refused, is handed back at once.
func TestWriteKeep(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode    sector.Mode
		version uint32
		s       int
	}{
		{sector.ModeXChaCha20Poly1305, 0, 512},
		{sector.ModeXChaCha20Poly1305, layout.Version2, 4096},
		{sector.ModeXChaCha20Poly1305, layout.Version2, 512},
		{sector.ModeAESXTS256, 0, 512},
	} {
		t.Run(fmt.Sprintf("%v/v%d/%d", tc.mode, tc.version, tc.s), func(t *testing.T) {
			t.Parallel()
			const sectors = 3000
			v := newTestVolVersion(t, tc.version, tc.mode, tc.s, sectors)
			d := v.open(t)
			size := int64(sectors * tc.s)
			model := make([]byte, size)
			if !tc.mode.Authenticated() {
				// Sectors never written read as the decryption of zeroes there.
				if err := d.WriteAt(model, 0, 0); err != nil {
					t.Fatal(err)
				}
			}
			var given, returned atomic.Int64
			rng := rand.New(rand.NewPCG(5, uint64(tc.s)))
			for op := range 400 {
				off := rng.Int64N(size)
				var n int64
				switch rng.IntN(4) {
				case 0:
					off -= off % int64(tc.s)
					n = int64(tc.s) * (1 + rng.Int64N(4))
				case 1:
					n = 1 + rng.Int64N(int64(3*tc.s))
				case 2:
					off -= off % int64(tc.s)
					n = int64(tc.s) * (1 + rng.Int64N(600)) // beyond a piece
				default:
					n = 1 + rng.Int64N(int64(40*tc.s))
				}
				n = min(n, size-off)
				p := make([]byte, n)
				randFill(rng, p)
				copy(model[off:], p)
				fl := Flags(0)
				if rng.IntN(6) == 0 {
					fl = FUA
				}
				if rng.IntN(4) == 0 {
					if err := d.WriteAt(p, off, fl); err != nil {
						t.Fatal(err)
					}
				} else {
					given.Add(1)
					var once atomic.Bool
					if err := d.WriteKeep(p, off, fl, func() {
						if once.Swap(true) {
							t.Errorf("op %d: buffer handed back twice", op)
						}
						returned.Add(1)
					}); err != nil {
						t.Fatal(err)
					}
				}
				if rng.IntN(10) == 0 {
					if err := d.Flush(); err != nil {
						t.Fatal(err)
					}
					if g, r := given.Load(), returned.Load(); g != r {
						t.Fatalf("op %d: after a Flush, %d of %d kept buffers handed back", op, r, g)
					}
				}
				if rng.IntN(5) == 0 {
					lo := rng.Int64N(size)
					hi := min(size, lo+1+rng.Int64N(int64(50*tc.s)))
					got := make([]byte, hi-lo)
					if err := d.ReadAt(got, lo); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, model[lo:hi]) {
						t.Fatalf("op %d: [%d, %d) reads other than written", op, lo, hi)
					}
				}
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			if g, r := given.Load(), returned.Load(); g != r {
				t.Fatalf("after Close, %d of %d kept buffers handed back", r, g)
			}
			d = v.open(t)
			defer d.Close()
			got := make([]byte, size)
			if err := d.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, model) {
				t.Fatal("reopened volume differs from what was written")
			}
			// Refused: handed back at once.
			called := false
			if err := d.WriteKeep(make([]byte, 100), size, 0, func() { called = true }); err == nil || !called {
				t.Fatalf("write past the end: %v, handed back %v", err, called)
			}
		})
	}
}

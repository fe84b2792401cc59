package sector

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/aesxts"
)

// TestRunMatchesSectors: for every length-preserving mode, sector sizes 512 and 4096 and
// runs of 1..40 sectors (several batches of subkeys and every remainder), SealRun gives
// byte for byte what Seal gives sector by sector, and OpenRun what Open gives, in place
// and out of place, with buffers at odd offsets, and with first indexes that make the
// run wrap past 2^64−1 as the per-sector indexes do.
func TestRunMatchesSectors(t *testing.T) {
	t.Parallel()
	for _, m := range lengthPreserving() {
		for _, size := range []int{512, 4096} {
			t.Run(fmt.Sprintf("%s/%d", m, size), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(m), uint64(size)+1))
				c := newLPCodec(t, m, size, seededKey(r, m))
				run, ok := c.(Runner)
				if !ok {
					t.Fatalf("%s does not implement Runner", m)
				}
				for n := 1; n <= 40; n++ {
					firsts := []uint64{r.Uint64(), ^uint64(0) - uint64(n/2)} // the second wraps mid-run
					for fi, first := range firsts {
						p := seededBytes(r, n*size)
						want := bytes.Clone(p)
						for k := range n {
							c.Seal(first+uint64(k), want[k*size:(k+1)*size], nil)
						}
						// Out of place, source and destination at different odd offsets.
						off := (n*7 + fi*3) % 61
						src := append(make([]byte, off), p...)[off:]
						dst := make([]byte, n*size+64)[off+1 : off+1+n*size]
						run.SealRun(first, dst, src)
						if !bytes.Equal(dst, want) {
							t.Fatalf("n=%d first=%#x: SealRun differs from Seal at byte %d", n, first, diffAt(dst, want))
						}
						if !bytes.Equal(src, p) {
							t.Fatalf("n=%d: SealRun changed its source", n)
						}
						// In place.
						buf := append(make([]byte, off), p...)[off:]
						run.SealRun(first, buf, buf)
						if !bytes.Equal(buf, want) {
							t.Fatalf("n=%d first=%#x: in-place SealRun differs from Seal at byte %d", n, first, diffAt(buf, want))
						}
						// OpenRun undoes it, in place and out of place, like Open sector by sector.
						if err := run.OpenRun(first, dst, buf); err != nil {
							t.Fatal(err)
						}
						if !bytes.Equal(dst, p) {
							t.Fatalf("n=%d first=%#x: OpenRun out of place did not restore the plaintext", n, first)
						}
						if err := run.OpenRun(first, buf, buf); err != nil || !bytes.Equal(buf, p) {
							t.Fatalf("n=%d first=%#x: OpenRun in place: %v, restored %v", n, first, err, bytes.Equal(buf, p))
						}
					}
				}
			})
		}
	}
}

// TestRunKeystreamsDistinct guards against a batch path that reuses one sector's
// subkey or nonce for its neighbours: within a sealed run of zeroes, no two sectors
// are equal.
func TestRunKeystreamsDistinct(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	for _, m := range lengthPreserving() {
		if m == ModeNone {
			continue
		}
		c := newLPCodec(t, m, 512, seededKey(r, m))
		const n = 40
		buf := make([]byte, n*512)
		c.(Runner).SealRun(1000, buf, buf)
		seen := map[string]int{}
		for k := range n {
			s := string(buf[k*512 : (k+1)*512])
			if j, dup := seen[s]; dup {
				t.Fatalf("%s: sectors %d and %d of a run share their keystream", m, j, k)
			}
			seen[s] = k
		}
	}
}

func TestRunMisuse(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(5, 6))
	for _, m := range lengthPreserving() {
		c := newLPCodec(t, m, 512, seededKey(r, m))
		run := c.(Runner)
		buf := make([]byte, 6*512+100)
		orig := bytes.Clone(buf)
		tests := []struct {
			name     string
			dst, src []byte
			want     string
		}{
			{"partial sector", buf[:700], buf[:700], "multiple of its sector size 512"},
			{"dst shorter", buf[:512], buf[1024:2048], "multiple of its sector size 512"},
			{"dst longer", buf[:1536], buf[2048:3072], "multiple of its sector size 512"},
			{"shifted overlap", buf[1:1025], buf[:1024], "overlap"},
		}
		for _, tt := range tests {
			if msg := lpPanicMsg(func() { run.SealRun(0, tt.dst, tt.src) }); !strings.Contains(msg, tt.want) {
				t.Errorf("%s SealRun %s: panic %q, want one mentioning %q", m, tt.name, msg, tt.want)
			}
			if err := run.OpenRun(0, tt.dst, tt.src); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("%s OpenRun %s: error %v, want one mentioning %q", m, tt.name, err, tt.want)
			}
		}
		if !bytes.Equal(buf, orig) {
			t.Errorf("%s: a rejected run wrote to its buffers", m)
		}
		// An empty run is a run of zero sectors.
		run.SealRun(0, nil, nil)
		if err := run.OpenRun(0, buf[:0], buf[:0]); err != nil {
			t.Errorf("%s OpenRun of nothing: %v", m, err)
		}
		if m == ModeNone {
			continue // nothing to wipe
		}
		c.Wipe()
		if msg := lpPanicMsg(func() { run.SealRun(0, buf[:512], buf[:512]) }); !strings.Contains(msg, "after Wipe") {
			t.Errorf("%s SealRun after Wipe: panic %q", m, msg)
		}
		if msg := lpPanicMsg(func() { _ = run.OpenRun(0, buf[:512], buf[:512]) }); !strings.Contains(msg, "after Wipe") {
			t.Errorf("%s OpenRun after Wipe: panic %q", m, msg)
		}
	}
}

// TestRunNoAllocs: a run is one call per 64 KiB chunk of a request and must not allocate
// (not parallel: AllocsPerRun forbids it).
func TestRunNoAllocs(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for _, m := range lengthPreserving() {
		if allocsUnmeasurable != "" && (m == ModeAESXTS256 || m == ModeAESXTS128) && aesxts.Implementation() == "generic" {
			// The x/crypto/xts fallback keeps its tweak buffers in a sync.Pool, which
			// -race drops; aesxts's assembly allocates nothing in any build.
			t.Logf("%s: %s", m, allocsUnmeasurable)
			continue
		}
		run := newLPCodec(t, m, 512, seededKey(r, m)).(Runner)
		buf := make([]byte, 128*512)
		out := make([]byte, len(buf))
		first := uint64(0)
		if a := testing.AllocsPerRun(20, func() { first += 128; run.SealRun(first, out, buf) }); a != 0 {
			t.Errorf("%s SealRun: %v allocations per call", m, a)
		}
		if a := testing.AllocsPerRun(20, func() { first += 128; _ = run.OpenRun(first, buf, buf) }); a != 0 {
			t.Errorf("%s OpenRun: %v allocations per call", m, a)
		}
	}
}

func diffAt(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

package sector

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"syscall"
	"testing"

	"github.com/elidisk/eli/internal/poly1305"
	"golang.org/x/crypto/chacha20poly1305"
)

// aeadPaths builds the xchacha20-poly1305 codec once per implementation this machine
// runs: our composition (chacha + poly1305) where the vector Poly1305 exists, and
// x/crypto's AEAD always, so that both are tested wherever the tests run.
func aeadPaths(t testing.TB, size int) map[string]*aeadCodec {
	t.Helper()
	paths := map[string]*aeadCodec{}
	for _, fast := range []bool{false, true} {
		if fast && !poly1305.Accelerated() {
			continue
		}
		c := newTestAEAD(t, size, testVol).(*aeadCodec)
		c.fast = fast
		name := "x/crypto"
		if fast {
			name = "chacha+poly1305"
		}
		paths[name] = c
	}
	return paths
}

// TestSealRunMetaMatchesXCrypto: every sector of a run, sealed by SealRunMeta, is what
// x/crypto's XChaCha20-Poly1305 gives for the nonce in its record and the spec's
// additional data, and what x/crypto seals, OpenRunMeta opens; for run lengths around
// the 16-sector chunk, in place and not.
func TestSealRunMetaMatchesXCrypto(t *testing.T) {
	t.Parallel()
	ref, err := chacha20poly1305.NewX(testKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, size := range []int{512, 4096} {
		for name, c := range aeadPaths(t, size) {
			for _, n := range []int{1, 2, 15, 16, 17, 40} {
				for _, inPlace := range []bool{false, true} {
					what := fmt.Sprintf("%s size %d n %d inPlace %v", name, size, n, inPlace)
					first := uint64(n*1000 + size)
					plain := randBytes(n * size)
					src := bytes.Clone(plain)
					dst := make([]byte, len(src))
					if inPlace {
						dst = src
					}
					meta := make([]byte, n*aeadMetaSize)
					c.SealRunMeta(first, dst, src, meta)
					if !inPlace && !bytes.Equal(src, plain) {
						t.Fatalf("%s: SealRunMeta changed its source", what)
					}
					for k := range n {
						rec := meta[k*aeadMetaSize : (k+1)*aeadMetaSize]
						ad := specAD(testVol, 1, uint32(size), first+uint64(k))
						want := ref.Seal(nil, rec[:aeadNonceSize], plain[k*size:(k+1)*size], ad)
						if !bytes.Equal(dst[k*size:(k+1)*size], want[:size]) || !bytes.Equal(rec[aeadNonceSize:], want[size:]) {
							t.Fatalf("%s: sector %d differs from x/crypto's seal under its own nonce", what, k)
						}
					}
					// x/crypto seals, the run opens.
					cts := make([]byte, n*size)
					for k := range n {
						rec := meta[k*aeadMetaSize : (k+1)*aeadMetaSize]
						copy(rec[:aeadNonceSize], randBytes(aeadNonceSize))
						out := ref.Seal(nil, rec[:aeadNonceSize], plain[k*size:(k+1)*size], specAD(testVol, 1, uint32(size), first+uint64(k)))
						copy(cts[k*size:], out[:size])
						copy(rec[aeadNonceSize:], out[size:])
					}
					out := make([]byte, len(cts))
					if inPlace {
						out = cts
					}
					if err := c.OpenRunMeta(first, out, cts, meta); err != nil {
						t.Fatalf("%s: OpenRunMeta of x/crypto's sectors: %v", what, err)
					}
					if !bytes.Equal(out, plain) {
						t.Fatalf("%s: OpenRunMeta returned other plaintext", what)
					}
				}
			}
		}
	}
}

// TestOpenRunMetaNamesEachBadSector damages some sectors of a run (ciphertext, nonce or
// tag, one bit) and checks that exactly those are zeroed and named, that ErrAuth and EIO
// are in the chain, and that every other sector still opens.
func TestOpenRunMetaNamesEachBadSector(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	// Runs whose last chunk is one sector, and one that is not, of sizes either side of
	// loneFastSize: a lone sector takes either path.
	for _, sn := range [][2]int{{512, 37}, {512, 17}, {512, 1}, {4096, 17}, {4096, 1}} {
		size, n := sn[0], sn[1]
		for name, c := range aeadPaths(t, size) {
			for round := range 20 {
				plain := randBytes(n * size)
				buf := bytes.Clone(plain)
				meta := make([]byte, n*aeadMetaSize)
				c.SealRunMeta(100, buf, buf, meta)
				var bad []uint64
				for k := range n {
					if r.IntN(4) != 0 {
						continue
					}
					bad = append(bad, 100+uint64(k))
					switch r.IntN(3) {
					case 0: // ciphertext
						buf[k*size+r.IntN(size)] ^= 1 << r.IntN(8)
					case 1: // nonce
						meta[k*aeadMetaSize+r.IntN(aeadNonceSize)] ^= 1 << r.IntN(8)
					default: // tag
						meta[k*aeadMetaSize+aeadNonceSize+r.IntN(aeadTagSize)] ^= 1 << r.IntN(8)
					}
				}
				out := make([]byte, len(buf))
				for i := range out {
					out[i] = 0xa5
				}
				if round%2 == 1 {
					out = buf
				}
				err := c.OpenRunMeta(100, out, buf, meta)
				if len(bad) == 0 {
					if err != nil {
						t.Fatalf("%s: nothing damaged, got %v", name, err)
					}
					continue
				}
				var re *RunAuthError
				if !errors.As(err, &re) || !slices.Equal(re.Sectors, bad) {
					t.Fatalf("%s: damaged %v, error %v", name, bad, err)
				}
				if !errors.Is(err, ErrAuth) || !errors.Is(err, syscall.EIO) {
					t.Fatalf("%s: %v does not wrap ErrAuth and EIO", name, err)
				}
				for k := range n {
					sec := out[k*size : (k+1)*size]
					if slices.Contains(bad, 100+uint64(k)) {
						if !bytes.Equal(sec, make([]byte, size)) {
							t.Fatalf("%s: damaged sector %d was not zeroed", name, k)
						}
					} else if !bytes.Equal(sec, plain[k*size:(k+1)*size]) {
						t.Fatalf("%s: intact sector %d did not open", name, k)
					}
				}
			}
		}
	}
}

// TestRunMetaRefusesBadArguments: lengths that are not whole sectors with a record each,
// and records that overlap the sectors, panic (SealRunMeta) or fail (OpenRunMeta) before
// anything is written.
func TestRunMetaRefusesBadArguments(t *testing.T) {
	t.Parallel()
	for name, c := range aeadPaths(t, 512) {
		buf := make([]byte, 2*512+80)
		for what, args := range map[string][3][]byte{
			"short records":      {buf[:1024], buf[:1024], make([]byte, 40)},
			"uneven sectors":     {buf[:1000], buf[:1000], make([]byte, 80)},
			"unequal dst":        {make([]byte, 512), buf[:1024], make([]byte, 80)},
			"records in sectors": {buf[:1024], buf[:1024], buf[1000:1080]},
			"shifted overlap":    {buf[1:1025], buf[:1024], make([]byte, 80)},
		} {
			orig := bytes.Clone(args[0])
			if err := c.OpenRunMeta(0, args[0], args[1], args[2]); err == nil {
				t.Errorf("%s %s: OpenRunMeta accepted it", name, what)
			}
			if !bytes.Equal(args[0], orig) {
				t.Errorf("%s %s: OpenRunMeta wrote before refusing", name, what)
			}
			func() {
				defer func() {
					if recover() == nil {
						t.Errorf("%s %s: SealRunMeta did not panic", name, what)
					}
				}()
				c.SealRunMeta(0, args[0], args[1], args[2])
			}()
		}
	}
}

func TestRunMetaNoAllocations(t *testing.T) {
	if allocsUnmeasurable != "" {
		t.Skip(allocsUnmeasurable)
	}
	for name, c := range aeadPaths(t, 4096) {
		const n = 20
		buf := make([]byte, n*4096)
		meta := make([]byte, n*aeadMetaSize)
		c.SealRunMeta(1, buf, buf, meta) // warm the scratch pool
		allocs := testing.AllocsPerRun(50, func() {
			c.SealRunMeta(1, buf, buf, meta)
			if err := c.OpenRunMeta(1, buf, buf, meta); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("%s: %.1f allocations per SealRunMeta+OpenRunMeta, want 0", name, allocs)
		}
	}
}

// BenchmarkRunMeta seals and opens runs of 256 sectors (1 MiB of 4 KiB sectors) on one
// core (opening out of place, so the input stays sealed), each implementation beside
// x/crypto's AEAD called sector by sector, as the reference of issue 4 does.
func BenchmarkRunMeta(b *testing.B) {
	for _, size := range []int{512, 4096} {
		n := 1 << 20 / size
		for name, c := range aeadPaths(b, size) {
			benchSealOpen(b, name, c, n)
		}
		b.Run(fmt.Sprintf("raw-x/crypto/seal/%d", size), func(b *testing.B) {
			ref, _ := chacha20poly1305.NewX(testKey)
			buf := make([]byte, size+16)
			nonce := randBytes(24)
			ad := make([]byte, adSize)
			b.SetBytes(int64(n * size))
			for b.Loop() {
				for range n {
					ref.Seal(buf[:0], nonce, buf[:size], ad)
				}
			}
		})
	}
}

// BenchmarkLoneSeal seals one 4 KiB sector in place, what a lone random write costs the
// cipher, through each path: the sector in cache (hot), and each time the next sector of
// a 4 MiB ring (ring), as a batch's buffers are when the server's writes go round them.
func BenchmarkLoneSeal(b *testing.B) {
	for name, c := range aeadPaths(b, 4096) {
		for _, r := range []struct {
			where string
			size  int
		}{{"hot", 4096}, {"ring", 4 << 20}} {
			b.Run(name+"/"+r.where, func(b *testing.B) {
				buf := randBytes(r.size)
				meta := make([]byte, aeadMetaSize)
				b.SetBytes(4096)
				off := 0
				for b.Loop() {
					c.SealRunMeta(0, buf[off:off+4096], buf[off:off+4096], meta)
					off = (off + 4096) % r.size
				}
			})
		}
	}
}

// BenchmarkLoneSector seals and opens one sector at a time, a lone random write's and
// read's cost to the cipher, at each sector size through x/crypto's fused AEAD and
// through the lanes, below loneFastSize too (loneMin 0): loneFastSize is the least size
// at which the lanes win (viaXCrypto).
func BenchmarkLoneSector(b *testing.B) {
	if !poly1305.Accelerated() {
		b.Skip("no vector Poly1305 on this machine: lone sectors always go through x/crypto")
	}
	for _, size := range []int{512, 1024, 2048, 4096} {
		for name, c := range aeadPaths(b, size) {
			c.loneMin = 0
			benchSealOpen(b, name, c, 1)
		}
	}
}

// benchSealOpen runs c's SealRunMeta in place and its OpenRunMeta out of place (so that
// the input stays sealed) over runs of n sectors, as NAME/seal/SIZE and NAME/open/SIZE.
func benchSealOpen(b *testing.B, name string, c *aeadCodec, n int) {
	for _, open := range []bool{false, true} {
		op := "seal"
		if open {
			op = "open"
		}
		b.Run(fmt.Sprintf("%s/%s/%d", name, op, c.size), func(b *testing.B) {
			buf := randBytes(n * c.size)
			meta := make([]byte, n*aeadMetaSize)
			c.SealRunMeta(0, buf, buf, meta)
			b.SetBytes(int64(len(buf)))
			out := make([]byte, len(buf))
			for b.Loop() {
				if open {
					if err := c.OpenRunMeta(0, out, buf, meta); err != nil {
						b.Fatal(err)
					}
				} else {
					c.SealRunMeta(0, buf, buf, meta)
				}
			}
		})
	}
}

// BenchmarkSealRunDestination: SealRunMeta of 64 KiB runs of 4 KiB sectors from one
// buffer into a ring of the given size, so that the destination is in cache (64 KiB,
// 4 MiB) or 64 MiB away in memory, as a device's batches of sealed data are when they
// grow large (blockdev's adaptLimit keeps them small where syncs are cheap).
func BenchmarkSealRunDestination(b *testing.B) {
	const run = 64 << 10
	for name, c := range aeadPaths(b, 4096) {
		for _, ring := range []int{64 << 10, 4 << 20, 64 << 20} {
			b.Run(fmt.Sprintf("%s/ring=%dKiB", name, ring>>10), func(b *testing.B) {
				src := randBytes(run)
				dst := make([]byte, ring)
				for i := range dst {
					dst[i] = 1 // faulted in: the ring is memory, not fresh pages
				}
				meta := make([]byte, run/4096*aeadMetaSize)
				b.SetBytes(run)
				off := 0
				for b.Loop() {
					c.SealRunMeta(0, dst[off:off+run], src, meta)
					off = (off + run) % ring
				}
			})
		}
	}
}

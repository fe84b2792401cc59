package chacha

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// hchachaManyRef is the reference for the batch kernels: the one-nonce HChaCha, nonce
// after nonce.
func hchachaManyRef(t testing.TB, rounds int, key *[KeySize]byte, nonces []byte) []byte {
	t.Helper()
	var want []byte
	for i := 0; i+HNonceSize <= len(nonces); i += HNonceSize {
		sub, err := HChaCha(rounds, key[:], nonces[i:i+HNonceSize])
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, sub[:]...)
	}
	return want
}

// TestHChaChaManyEngines runs every engine's batch HChaCha against the one-nonce HChaCha
// for every n in 0..40 (whole passes, padded remainders and the one-nonce remainder of
// each lane width), every round count, random keys and nonces, nonces and output at
// several misalignments, and checks that nothing outside the output is written and the
// nonces are left alone.
func TestHChaChaManyEngines(t *testing.T) {
	t.Parallel()
	const maxN = 40
	for _, e := range engines() {
		for _, rounds := range []int{8, 12, 20} {
			t.Run(fmt.Sprintf("%v/%d", e, rounds), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(e), uint64(rounds)))
				for n := 0; n <= maxN; n++ {
					for _, off := range []int{0, 1, 7, 16, 33} {
						var key [KeySize]byte
						fill(r, key[:])
						var st [16]uint32
						initState(&st, &key)
						in := make([]byte, off+n*HNonceSize)
						fill(r, in)
						nonces := in[off:]
						orig := bytes.Clone(nonces)
						want := hchachaManyRef(t, rounds, &key, nonces)

						buf, pattern := make([]byte, 2*guard+n*hSubkeySize+64), make([]byte, 2*guard+n*hSubkeySize+64)
						fill(r, pattern)
						copy(buf, pattern)
						at := guard + (off*5)%64
						hchachaManyEngine(e, &st, rounds, nonces, buf[at:at+n*hSubkeySize])
						checkOut(t, e, n*hSubkeySize, off, fmt.Sprintf("hchacha many (%d nonces)", n), buf, pattern, at, want)
						if !bytes.Equal(nonces, orig) {
							t.Fatalf("%v n=%d: the nonces changed", e, n)
						}
					}
				}
			})
		}
	}
}

// TestHChaChaManyVector puts the draft-irtf-cfrg-xchacha-03 §2.2.1 nonce at every
// position of batches of several sizes among random nonces, on every engine, and
// checks the published subkey comes out at that position.
func TestHChaChaManyVector(t *testing.T) {
	t.Parallel()
	key := (*[KeySize]byte)(seq(0, 32))
	nonce := unhex(t, "000000090000004a0000000031415927")
	want := unhex(t, "82413b4227b27bfed30e42508a877d73a0f9e4d58a74a853c12ec41326d3ecdc")
	r := rand.New(rand.NewPCG(5, 5))
	var st [16]uint32
	initState(&st, key)
	for _, e := range engines() {
		for _, n := range []int{1, 2, 7, 8, 9, 15, 16, 17, 24, 32, 33} {
			for pos := 0; pos < n; pos++ {
				nonces := make([]byte, n*HNonceSize)
				fill(r, nonces)
				copy(nonces[pos*HNonceSize:], nonce)
				out := make([]byte, n*hSubkeySize)
				hchachaManyEngine(e, &st, 20, nonces, out)
				if got := out[pos*hSubkeySize : (pos+1)*hSubkeySize]; !bytes.Equal(got, want) {
					t.Fatalf("%v, %d nonces, vector at %d: got %x want %x", e, n, pos, got, want)
				}
			}
		}
	}
	// And through the exported call, on whatever engine this machine picks.
	out := make([]byte, 3*hSubkeySize)
	nonces := append(append(make([]byte, HNonceSize), nonce...), make([]byte, HNonceSize)...)
	HChaChaMany(20, key, nonces, out)
	if !bytes.Equal(out[hSubkeySize:2*hSubkeySize], want) {
		t.Fatalf("HChaChaMany: got %x want %x", out[hSubkeySize:2*hSubkeySize], want)
	}
}

// TestXORKeyStreamMany checks the many-message calls against XORKeyStreamXAt and
// XORKeyStreamAt message by message, for every engine, n in 0..40 and several message
// lengths, in place and out of place at odd offsets.
func TestXORKeyStreamMany(t *testing.T) {
	t.Parallel()
	for _, e := range engines() {
		for _, rounds := range []int{8, 12, 20} {
			for _, nonceSize := range []int{NonceSize, NonceSizeX} {
				t.Run(fmt.Sprintf("%v/%d/nonce%d", e, rounds, nonceSize), func(t *testing.T) {
					t.Parallel()
					r := rand.New(rand.NewPCG(uint64(e)+10, uint64(rounds)))
					for n := 0; n <= 40; n++ {
						for _, m := range []int{0, 1, 64, 100, 512, 4096} {
							if m == 4096 && n%7 != 0 {
								continue // keep the run short: a few large ones are enough
							}
							var key [KeySize]byte
							fill(r, key[:])
							nonces := make([]byte, n*nonceSize)
							fill(r, nonces)
							src := make([]byte, n*m+3)[3:]
							fill(r, src)
							want := make([]byte, n*m)
							for i := 0; i < n; i++ {
								if nonceSize == NonceSizeX {
									XORKeyStreamXAt(rounds, &key, (*[NonceSizeX]byte)(nonces[i*NonceSizeX:]), 0, want[i*m:(i+1)*m], src[i*m:(i+1)*m])
								} else {
									XORKeyStreamAt(rounds, &key, (*[NonceSize]byte)(nonces[i*NonceSize:]), 0, want[i*m:(i+1)*m], src[i*m:(i+1)*m])
								}
							}
							dst := make([]byte, n*m+64)[5:]
							xorMany(e, rounds, &key, nonceSize, nonces, dst, src)
							if !bytes.Equal(dst[:n*m], want) {
								t.Fatalf("%v n=%d m=%d out of place: first difference at %d", e, n, m, firstDiff(dst, want))
							}
							if bytes.Count(dst[n*m:], []byte{0}) != len(dst)-n*m {
								t.Fatalf("%v n=%d m=%d: wrote past len(src)", e, n, m)
							}
							xorMany(e, rounds, &key, nonceSize, nonces, src, src)
							if !bytes.Equal(src, want) {
								t.Fatalf("%v n=%d m=%d in place: first difference at %d", e, n, m, firstDiff(src, want))
							}
						}
					}
				})
			}
		}
	}
}

func TestManyMisuse(t *testing.T) {
	t.Parallel()
	var key [KeySize]byte
	buf := make([]byte, 4096)
	tests := []struct {
		name string
		f    func()
		want string
	}{
		{"hchacha rounds", func() { HChaChaMany(10, &key, buf[:16], buf[16:48]) }, "rounds"},
		{"hchacha nonce length", func() { HChaChaMany(20, &key, buf[:17], buf[100:132]) }, "not a multiple of 16"},
		{"hchacha short out", func() { HChaChaMany(20, &key, buf[:32], buf[100:163]) }, "want 64"},
		{"hchacha long out", func() { HChaChaMany(20, &key, buf[:32], buf[100:165]) }, "want 64"},
		{"hchacha overlap", func() { HChaChaMany(20, &key, buf[:32], buf[31:95]) }, "overlaps"},
		{"x rounds", func() { XORKeyStreamXMany(7, &key, buf[:24], buf[100:200], buf[100:200]) }, "rounds"},
		{"x nonce length", func() { XORKeyStreamXMany(20, &key, buf[:25], buf[100:200], buf[100:200]) }, "not a multiple of 24"},
		{"x uneven split", func() { XORKeyStreamXMany(20, &key, buf[:48], buf[100:201], buf[100:201]) }, "equal messages"},
		{"x no nonces", func() { XORKeyStreamXMany(20, &key, nil, buf[100:101], buf[100:101]) }, "equal messages"},
		{"x short dst", func() { XORKeyStreamXMany(20, &key, buf[:24], buf[100:110], buf[200:220]) }, "output smaller"},
		{"x shifted overlap", func() { XORKeyStreamXMany(20, &key, buf[:24], buf[101:201], buf[100:200]) }, "overlap"},
		{"x nonces in dst", func() { XORKeyStreamXMany(20, &key, buf[:24], buf[10:110], buf[10:110]) }, "overlaps the nonces"},
		{"rounds", func() { XORKeyStreamMany(9, &key, buf[:12], buf[100:200], buf[100:200]) }, "rounds"},
		{"uneven split", func() { XORKeyStreamMany(20, &key, buf[:24], buf[100:201], buf[100:201]) }, "equal messages"},
		{"nonce size", func() { XORKeyStreamMany(20, &key, buf[:13], buf[100:200], buf[100:200]) }, "not a multiple of 12"},
		{"nonces in dst", func() { XORKeyStreamMany(20, &key, buf[:12], buf[0:100], buf[0:100]) }, "overlaps the nonces"},
	}
	for _, tt := range tests {
		if msg := panics(tt.f); !strings.Contains(msg, tt.want) {
			t.Errorf("%s: panic %q, want one mentioning %q", tt.name, msg, tt.want)
		}
	}
	// Nothing to do is not an error.
	HChaChaMany(20, &key, nil, nil)
	XORKeyStreamXMany(20, &key, nil, nil, nil)
	XORKeyStreamXMany(20, &key, buf[:48], buf[100:100], buf[100:100])
	XORKeyStreamMany(20, &key, buf[:48], buf[100:100], buf[100:100])
}

// TestManyNoAllocs: both calls run once per run of disk sectors (not parallel:
// AllocsPerRun forbids it).
func TestManyNoAllocs(t *testing.T) {
	var key [KeySize]byte
	nonces := make([]byte, 40*NonceSizeX)
	out := make([]byte, 40*hSubkeySize)
	buf := make([]byte, 40*512)
	if a := testing.AllocsPerRun(20, func() { HChaChaMany(20, &key, nonces[:40*HNonceSize], out) }); a != 0 {
		t.Errorf("HChaChaMany: %v allocations per call", a)
	}
	if a := testing.AllocsPerRun(20, func() { XORKeyStreamXMany(20, &key, nonces, buf, buf) }); a != 0 {
		t.Errorf("XORKeyStreamXMany: %v allocations per call", a)
	}
	if a := testing.AllocsPerRun(20, func() { XORKeyStreamMany(20, &key, nonces[:40*NonceSize], buf, buf) }); a != 0 {
		t.Errorf("XORKeyStreamMany: %v allocations per call", a)
	}
}

// FuzzHChaChaMany compares every engine's batch HChaCha with the generic one on random
// keys, nonce counts and round counts.
func FuzzHChaChaMany(f *testing.F) {
	f.Add(make([]byte, 32), uint8(20), make([]byte, 16*17))
	f.Add(seq(3, 32), uint8(8), seq(1, 16*9))
	f.Fuzz(func(t *testing.T, key []byte, roundsSel uint8, nonces []byte) {
		var k [KeySize]byte
		copy(k[:], key)
		var st [16]uint32
		initState(&st, &k)
		rounds := []int{8, 12, 20}[int(roundsSel)%3]
		nonces = nonces[:len(nonces)/HNonceSize*HNonceSize]
		want := make([]byte, 2*len(nonces))
		hchachaManyGeneric(&st, rounds, nonces, want)
		for _, e := range engines()[1:] {
			got := make([]byte, len(want))
			hchachaManyEngine(e, &st, rounds, nonces, got)
			if !bytes.Equal(got, want) {
				t.Fatalf("%v, %d nonces: first difference at %d", e, len(nonces)/HNonceSize, firstDiff(got, want))
			}
		}
	})
}

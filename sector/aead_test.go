package sector

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/crypto/chacha20poly1305"
)

var (
	testKey = bytes.Repeat([]byte{0x42}, 32)
	testVol = [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
)

// specAD builds the additional data from docs/format.md ("Sector seal") field by field,
// independently of the codec, so the cross-checks below test the codec against the spec.
func specAD(vol [16]byte, mode byte, sectorSize uint32, index uint64) []byte {
	ad := []byte("eli-sector-v1")
	ad = append(ad, vol[:]...)
	ad = append(ad, mode)
	ad = binary.LittleEndian.AppendUint32(ad, sectorSize)
	ad = binary.LittleEndian.AppendUint64(ad, index)
	if len(ad) != 42 {
		panic("spec ad length")
	}
	return ad
}

func newTestAEAD(t testing.TB, size int, vol [16]byte) Codec {
	t.Helper()
	c, err := New(Params{Mode: ModeXChaCha20Poly1305, SectorSize: size, Key: testKey, VolumeID: vol})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// spareGuard is the spare capacity slackBuf leaves behind a buffer: room x/crypto's AEAD
// would put a tag in, which the codec must leave alone (checkSpare).
const spareGuard = 16

// slackBuf returns a copy of p with spareGuard bytes of spare capacity holding a
// pattern, or none when tight.
func slackBuf(p []byte, tight bool) []byte {
	if tight {
		return append([]byte(nil), p...)[:len(p):len(p)]
	}
	b := make([]byte, len(p), len(p)+spareGuard)
	copy(b, p)
	for i := range spareGuard {
		b[:cap(b)][len(p)+i] = 0xa5
	}
	return b
}

// checkSpare fails if anything wrote past len(b) into slackBuf's spare capacity.
func checkSpare(t testing.TB, b []byte) {
	t.Helper()
	for _, v := range b[len(b):cap(b)] {
		if v != 0xa5 {
			t.Fatal("the codec wrote past the end of the sector buffer")
		}
	}
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func TestAEADSealMatchesXChaCha(t *testing.T) {
	t.Parallel()
	ref, err := chacha20poly1305.NewX(testKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, size := range []int{512, 4096, 65536} {
		for _, tight := range []bool{false, true} {
			c := newTestAEAD(t, size, testVol)
			for _, index := range []uint64{0, 1, 101, 1<<40 + 7, ^uint64(0)} {
				plain := randBytes(size)
				buf := slackBuf(plain, tight)
				meta := make([]byte, 40)
				c.Seal(index, buf, meta)
				checkSpare(t, buf)
				if bytes.Equal(buf, plain) {
					t.Fatalf("size %d index %d: Seal left the plaintext in place", size, index)
				}
				// The record is nonce ‖ tag, and the sector is the ciphertext, exactly as
				// XChaCha20-Poly1305 produces them with the spec's additional data.
				sealed := append(append([]byte(nil), buf...), meta[24:]...)
				got, err := ref.Open(nil, meta[:24], sealed, specAD(testVol, 1, uint32(size), index))
				if err != nil {
					t.Fatalf("size %d index %d tight %v: reference Open of codec output: %v", size, index, tight, err)
				}
				if !bytes.Equal(got, plain) {
					t.Fatalf("size %d index %d: reference Open returned other plaintext", size, index)
				}
				// And the other way: what the reference seals, the codec opens.
				nonce := randBytes(24)
				want := randBytes(size)
				out := ref.Seal(nil, nonce, want, specAD(testVol, 1, uint32(size), index))
				buf = slackBuf(out[:size], tight)
				meta = append(append([]byte(nil), nonce...), out[size:]...)
				if err := c.Open(index, buf, meta); err != nil {
					t.Fatalf("size %d index %d tight %v: codec Open of reference output: %v", size, index, tight, err)
				}
				checkSpare(t, buf)
				if !bytes.Equal(buf, want) {
					t.Fatalf("size %d index %d: codec Open returned other plaintext", size, index)
				}
			}
		}
	}
}

// Every field of the additional data and of the record matters: each variant below is
// sealed by the reference implementation with one thing changed, and the codec (volume
// testVol, 4096-byte sectors, index 7) must refuse it.
func TestAEADBindsEveryField(t *testing.T) {
	t.Parallel()
	ref, err := chacha20poly1305.NewX(testKey)
	if err != nil {
		t.Fatal(err)
	}
	otherVol := testVol
	otherVol[15] ^= 0x80
	const size, index = 4096, 7
	cases := []struct {
		name string
		ad   []byte
		key  []byte
		mut  func(ct, meta []byte)
	}{
		{name: "unchanged"},
		{name: "index", ad: specAD(testVol, 1, size, index+1)},
		{name: "index high bit", ad: specAD(testVol, 1, size, index|1<<63)},
		{name: "volume", ad: specAD(otherVol, 1, size, index)},
		{name: "mode", ad: specAD(testVol, byte(ModeAESXTS256), size, index)},
		{name: "sector size", ad: specAD(testVol, 1, 512, index)},
		{name: "label", ad: append([]byte("eli-sector-v2"), specAD(testVol, 1, size, index)[13:]...)},
		{name: "key", key: bytes.Repeat([]byte{0x43}, 32)},
		{name: "ciphertext bit", mut: func(ct, _ []byte) { ct[size-1] ^= 1 }},
		{name: "nonce bit", mut: func(_, meta []byte) { meta[3] ^= 0x10 }},
		{name: "tag bit", mut: func(_, meta []byte) { meta[39] ^= 0x01 }},
		{name: "zero record", mut: func(_, meta []byte) { clear(meta) }},
	}
	c := newTestAEAD(t, size, testVol)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ad := tc.ad
			if ad == nil {
				ad = specAD(testVol, 1, size, index)
			}
			a := ref
			if tc.key != nil {
				if a, err = chacha20poly1305.NewX(tc.key); err != nil {
					t.Fatal(err)
				}
			}
			nonce := randBytes(24)
			plain := randBytes(size)
			out := a.Seal(nil, nonce, plain, ad)
			buf := slackBuf(out[:size], false)
			meta := append(append([]byte(nil), nonce...), out[size:]...)
			if tc.mut != nil {
				tc.mut(buf, meta)
			}
			err := c.Open(index, buf, meta)
			if tc.name == "unchanged" {
				if err != nil || !bytes.Equal(buf, plain) {
					t.Fatalf("control case does not open: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("opened a sector sealed with a changed field")
			}
			if !errors.Is(err, ErrAuth) || !errors.Is(err, syscall.EIO) {
				t.Fatalf("error %v does not wrap ErrAuth and EIO", err)
			}
			if bytes.Equal(buf, plain) {
				t.Fatal("failed Open left the plaintext in the buffer")
			}
		})
	}
}

// A one-sector SealRunMeta out of place gives what Seal gives, leaves its source alone,
// and works with and without spare capacity in the destination.
func TestAEADSealOutOfPlace(t *testing.T) {
	t.Parallel()
	ref, _ := chacha20poly1305.NewX(testKey)
	c := newTestAEAD(t, 4096, testVol).(*aeadCodec)
	for _, tight := range []bool{false, true} {
		src := randBytes(4096)
		keep := bytes.Clone(src)
		dst := slackBuf(make([]byte, 4096), tight)
		meta := make([]byte, 40)
		c.SealRunMeta(9, dst, src, meta)
		checkSpare(t, dst)
		if !bytes.Equal(src, keep) {
			t.Fatal("SealRunMeta changed its source")
		}
		got, err := ref.Open(nil, meta[:24], append(bytes.Clone(dst), meta[24:]...), specAD(testVol, 1, 4096, 9))
		if err != nil || !bytes.Equal(got, src) {
			t.Fatalf("tight=%v: reference Open of SealRunMeta output: %v", tight, err)
		}
	}
}

func TestAEADNoncesFresh(t *testing.T) {
	t.Parallel()
	c := newTestAEAD(t, 512, testVol)
	seen := make(map[string]bool)
	plain := make([]byte, 512)
	var first []byte
	for i := range 2000 {
		buf := slackBuf(plain, false)
		meta := make([]byte, 40)
		c.Seal(5, buf, meta) // same index, same plaintext every time
		if seen[string(meta[:24])] {
			t.Fatalf("nonce repeated after %d seals", i)
		}
		seen[string(meta[:24])] = true
		if first == nil {
			first = buf
		} else if bytes.Equal(first, buf) {
			t.Fatal("two seals of one plaintext at one index gave the same ciphertext")
		}
	}
}

func TestAEADNoAllocations(t *testing.T) {
	if allocsUnmeasurable != "" {
		t.Skip(allocsUnmeasurable)
	}
	for _, tight := range []bool{false, true} {
		c := newTestAEAD(t, 4096, testVol)
		buf := slackBuf(make([]byte, 4096), tight)
		meta := make([]byte, 40)
		c.Seal(1, buf, meta) // warm the scratch pool
		src := make([]byte, 4096)
		allocs := testing.AllocsPerRun(200, func() {
			c.(*aeadCodec).SealRunMeta(1, buf, src, meta)
			c.Seal(1, buf, meta)
			if err := c.Open(1, buf, meta); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("tight=%v: %.1f allocations per SealRunMeta+Seal+Open, want 0", tight, allocs)
		}
	}
}

func TestAEADConcurrent(t *testing.T) {
	t.Parallel()
	c := newTestAEAD(t, 512, testVol)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			for i := range 300 {
				index := uint64(g*1000 + i)
				plain := randBytes(512)
				buf := slackBuf(plain, i%2 == 0)
				meta := make([]byte, 40)
				c.Seal(index, buf, meta)
				if err := c.Open(index, buf, meta); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(buf, plain) {
					errs <- errors.New("round trip changed the plaintext")
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

func TestAEADWipe(t *testing.T) {
	t.Parallel()
	// The reflection itself is tested in internal/wipe; here, that the codec uses it.
	key := make([]byte, 32)
	copy(key, testKey)
	c0, err := New(Params{Mode: ModeXChaCha20Poly1305, SectorSize: 512, Key: key, VolumeID: testVol})
	if err != nil {
		t.Fatal(err)
	}
	a := c0.(*aeadCodec).aead
	nonce := randBytes(24)
	sealed := a.Seal(nil, nonce, []byte("sector"), nil)
	c0.Wipe()
	if _, err := a.Open(nil, nonce, sealed, nil); err == nil {
		t.Fatal("the codec's AEAD still opens after Wipe")
	}

	c := newTestAEAD(t, 512, testVol)
	key32 := c.(*aeadCodec).key
	c.Wipe()
	if c.(*aeadCodec).aead != nil {
		t.Fatal("Wipe kept the AEAD")
	}
	if *key32 != [32]byte{} {
		t.Fatal("Wipe left the key of our own composition")
	}
}

func TestAEADRejectsBadKey(t *testing.T) {
	t.Parallel()
	if _, err := New(Params{Mode: ModeXChaCha20Poly1305, SectorSize: 4096, Key: make([]byte, 16)}); err == nil {
		t.Fatal("accepted a 16-byte key")
	}
}

func benchCodec(b *testing.B, size int, open bool) {
	c := newTestAEAD(b, size, testVol)
	buf := make([]byte, size)
	meta := make([]byte, 40)
	c.Seal(0, buf, meta)
	b.SetBytes(int64(size))
	b.ReportAllocs()
	for b.Loop() {
		if open {
			if err := c.Open(0, buf, meta); err != nil {
				b.Fatal(err)
			}
			// Open decrypted in place; reseal so the next iteration opens valid input
			// (this doubles the work, so the Open figure is a lower bound).
			c.Seal(0, buf, meta)
		} else {
			c.Seal(0, buf, meta)
		}
	}
}

func BenchmarkAEADSeal4K(b *testing.B)      { benchCodec(b, 4096, false) }
func BenchmarkAEADSeal512(b *testing.B)     { benchCodec(b, 512, false) }
func BenchmarkAEADRoundTrip4K(b *testing.B) { benchCodec(b, 4096, true) }

// BenchmarkXChaChaSeal4K is the same work straight through x/crypto with a fixed nonce:
// the codec's overhead (nonce, ad, scratch pool) is the difference.
func BenchmarkXChaChaSeal4K(b *testing.B) {
	a, _ := chacha20poly1305.NewX(testKey)
	buf := make([]byte, 4096, 4096+16)
	nonce := make([]byte, 24)
	ad := specAD(testVol, 1, 4096, 0)
	b.SetBytes(4096)
	for b.Loop() {
		a.Seal(buf[:0], nonce, buf, ad)
	}
}

// BenchmarkNonce is what one Seal pays crypto/rand (see the aeadCodec comment).
func BenchmarkNonce(b *testing.B) {
	var n [24]byte
	for b.Loop() {
		rand.Read(n[:])
	}
}

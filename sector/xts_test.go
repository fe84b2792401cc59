package sector

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/elidisk/eli/internal/chacha"
	"golang.org/x/crypto/chacha20"
)

// lengthPreserving lists the modes this file covers: every mode with MetaSize 0.
func lengthPreserving() []Mode {
	var ms []Mode
	for _, m := range Modes() {
		if m.MetaSize() == 0 {
			ms = append(ms, m)
		}
	}
	return ms
}

func seededBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func newLPCodec(t testing.TB, m Mode, size int, key []byte) Codec {
	t.Helper()
	c, err := New(Params{Mode: m, SectorSize: size, Key: key})
	if err != nil {
		t.Fatalf("New(%s, %d): %v", m, size, err)
	}
	return c
}

func seededKey(r *rand.Rand, m Mode) []byte { return seededBytes(r, m.KeySize()) }

func TestLengthPreservingRoundTrip(t *testing.T) {
	t.Parallel()
	for _, m := range lengthPreserving() {
		for _, size := range []int{MinSectorSize, 4096, MaxSectorSize} {
			t.Run(fmt.Sprintf("%s/%d", m, size), func(t *testing.T) {
				t.Parallel()
				r := rand.New(rand.NewPCG(uint64(m), uint64(size)))
				c := newLPCodec(t, m, size, seededKey(r, m))
				if c.Mode() != m || c.SectorSize() != size || c.MetaSize() != 0 {
					t.Fatalf("Mode, SectorSize, MetaSize = %v, %d, %d", c.Mode(), c.SectorSize(), c.MetaSize())
				}
				p := seededBytes(r, size)
				for _, index := range []uint64{0, 1, 0x0123456789abcdef, 1<<64 - 1} {
					buf := bytes.Clone(p)
					c.Seal(index, buf, nil)
					if m != ModeNone && bytes.Equal(buf, p) {
						t.Fatalf("index %#x: Seal left the plaintext unchanged", index)
					}
					again := bytes.Clone(p)
					c.Seal(index, again, nil)
					if !bytes.Equal(again, buf) {
						t.Fatalf("index %#x: a length-preserving mode must be deterministic", index)
					}
					other := bytes.Clone(p)
					c.Seal(index^1, other, nil)
					if m != ModeNone && bytes.Equal(other, buf) {
						t.Fatalf("index %#x and %#x encrypt alike", index, index^1)
					}
					if err := c.Open(index, buf, nil); err != nil {
						t.Fatalf("index %#x: Open: %v", index, err)
					}
					if !bytes.Equal(buf, p) {
						t.Fatalf("index %#x: Open(Seal(p)) != p", index)
					}
				}
			})
		}
	}
}

// TestAESXTSIEEE1619 checks aes-xts and aes128-xts against IEEE P1619 Annex B, with the
// data unit number as sector index.
func TestAESXTSIEEE1619(t *testing.T) {
	t.Parallel()
	for _, v := range ieee1619Vectors {
		key, _ := hex.DecodeString(v.key)
		pt, _ := hex.DecodeString(v.plaintext)
		want, _ := hex.DecodeString(v.ciphertext)
		m := ModeAESXTS128
		if len(key) == 64 {
			m = ModeAESXTS256
		}
		c := newLPCodec(t, m, len(pt), key)
		buf := bytes.Clone(pt)
		c.Seal(v.sector, buf, nil)
		if !bytes.Equal(buf, want) {
			t.Errorf("%s (%s): Seal differs from the IEEE vector", v.name, m)
		}
		if err := c.Open(v.sector, buf, nil); err != nil || !bytes.Equal(buf, pt) {
			t.Errorf("%s (%s): Open: %v, plaintext restored: %v", v.name, m, err, bytes.Equal(buf, pt))
		}
	}
}

// TestChaCha20XTSDerivation pins the documented nonce derivation of chacha20-xts and
// xchacha20-xts against golang.org/x/crypto/chacha20, an independent implementation.
func TestChaCha20XTSDerivation(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(11, 12))
	key := seededBytes(r, 32)
	for _, m := range []Mode{ModeChaCha20XTS, ModeXChaCha20XTS} {
		for _, size := range []int{512, 4096, 65536} {
			c := newLPCodec(t, m, size, key)
			for _, index := range []uint64{0, 7, 0x0123456789abcdef, 1<<64 - 1} {
				var nonce []byte
				if m == ModeChaCha20XTS {
					nonce = binary.LittleEndian.AppendUint64(nil, index)
					nonce = append(nonce, 0, 0, 0, 0)
				} else {
					nonce = binary.LittleEndian.AppendUint64(nil, index)
					nonce = append(nonce, make([]byte, 16)...)
				}
				ref, err := chacha20.NewUnauthenticatedCipher(key, nonce)
				if err != nil {
					t.Fatal(err)
				}
				p := seededBytes(r, size)
				want := make([]byte, size)
				ref.XORKeyStream(want, p)
				got := bytes.Clone(p)
				c.Seal(index, got, nil)
				if !bytes.Equal(got, want) {
					t.Fatalf("%s, %d bytes, index %#x: differs from x/crypto with the documented nonce", m, size, index)
				}
			}
		}
	}
}

// TestReducedRoundXTSDerivation pins the 8- and 12-round modes to the chacha package's
// streams (which are checked against published 8- and 12-round vectors there).
func TestReducedRoundXTSDerivation(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(13, 14))
	key := seededBytes(r, 32)
	tests := []struct {
		m      Mode
		rounds int
		x      bool
	}{
		{ModeChaCha12XTS, 12, false}, {ModeChaCha8XTS, 8, false},
		{ModeXChaCha12XTS, 12, true}, {ModeXChaCha8XTS, 8, true},
	}
	for _, tt := range tests {
		c := newLPCodec(t, tt.m, 4096, key)
		index := uint64(0xfeedface12345678)
		var s *chacha.Cipher
		var err error
		if tt.x {
			s, err = chacha.NewX(tt.rounds, key, append(binary.LittleEndian.AppendUint64(nil, index), make([]byte, 16)...))
		} else {
			s, err = chacha.New(tt.rounds, key, append(binary.LittleEndian.AppendUint64(nil, index), 0, 0, 0, 0))
		}
		if err != nil {
			t.Fatal(err)
		}
		p := seededBytes(r, 4096)
		want := make([]byte, 4096)
		s.XORKeyStream(want, p)
		c.Seal(index, p, nil)
		if !bytes.Equal(p, want) {
			t.Errorf("%s: differs from chacha.New/NewX with the documented nonce", tt.m)
		}
	}
}

func TestWrongSectorLength(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(15, 16))
	for _, m := range lengthPreserving() {
		if m == ModeNone {
			continue // not part of this change; it ignores lengths
		}
		c := newLPCodec(t, m, 4096, seededKey(r, m))
		for _, n := range []int{0, 4095, 4097, 8192} {
			err := c.Open(0, make([]byte, n), nil)
			if err == nil || !strings.Contains(err.Error(), "sector size is 4096") {
				t.Errorf("%s Open(%d bytes): %v", m, n, err)
			}
			msg := lpPanicMsg(func() { c.Seal(0, make([]byte, n), nil) })
			if !strings.Contains(msg, "sector size is 4096") {
				t.Errorf("%s Seal(%d bytes): panic %q", m, n, msg)
			}
		}
	}
}

func TestAESXTSEqualHalves(t *testing.T) {
	t.Parallel()
	for _, m := range []Mode{ModeAESXTS256, ModeAESXTS128} {
		half := bytes.Repeat([]byte{0x42}, m.KeySize()/2)
		_, err := New(Params{Mode: m, SectorSize: 512, Key: append(bytes.Clone(half), half...)})
		if err == nil || !strings.Contains(err.Error(), "halves are equal") {
			t.Errorf("%s with equal key halves: %v", m, err)
		}
	}
}

func TestWipe(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(17, 18))
	for _, m := range lengthPreserving() {
		if m == ModeNone {
			continue
		}
		c := newLPCodec(t, m, 512, seededKey(r, m))
		c.Wipe()
		if cx, ok := c.(*chachaXTS); ok && cx.key != [32]byte{} {
			t.Errorf("%s: key not zeroed by Wipe", m)
		}
		if msg := lpPanicMsg(func() { c.Seal(1, make([]byte, 512), nil) }); !strings.Contains(msg, "after Wipe") {
			t.Errorf("%s: Seal after Wipe: panic %q", m, msg)
		}
	}
}

// TestNoAllocs: Seal and Open run once per sector and must not allocate.
func TestNoAllocs(t *testing.T) {
	r := rand.New(rand.NewPCG(19, 20))
	for _, m := range lengthPreserving() {
		c := newLPCodec(t, m, 4096, seededKey(r, m))
		buf := make([]byte, 4096)
		index := uint64(0)
		if a := testing.AllocsPerRun(100, func() { index++; c.Seal(index, buf, nil) }); a != 0 {
			t.Errorf("%s Seal: %v allocations per call", m, a)
		}
		if a := testing.AllocsPerRun(100, func() { index++; _ = c.Open(index, buf, nil) }); a != 0 {
			t.Errorf("%s Open: %v allocations per call", m, a)
		}
	}
}

// TestConcurrentUse seals and opens from many goroutines on one codec; run with -race.
func TestConcurrentUse(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(21, 22))
	for _, m := range lengthPreserving() {
		c := newLPCodec(t, m, 512, seededKey(r, m))
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for g := 0; g < 8; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				rr := rand.New(rand.NewPCG(uint64(g), 99))
				for i := 0; i < 200; i++ {
					index := uint64(g*1000 + i)
					p := seededBytes(rr, 512)
					buf := bytes.Clone(p)
					c.Seal(index, buf, nil)
					if err := c.Open(index, buf, nil); err != nil || !bytes.Equal(buf, p) {
						errs <- fmt.Errorf("%s goroutine %d sector %d: round trip failed (%v)", m, g, index, err)
						return
					}
				}
			}(g)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	}
}

func lpPanicMsg(f func()) (msg string) {
	defer func() {
		if r := recover(); r != nil {
			msg = fmt.Sprint(r)
		}
	}()
	f()
	return ""
}

// TestSealRunOutOfPlace: a one-sector SealRun from one buffer into another gives what
// Seal gives, leaves its source alone, checks lengths and does not allocate (not
// parallel: AllocsPerRun forbids it).
func TestSealRunOutOfPlace(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 24))
	for _, m := range lengthPreserving() {
		if m == ModeNone {
			continue // not part of this change
		}
		c := newLPCodec(t, m, 4096, seededKey(r, m))
		st, ok := c.(Runner)
		if !ok {
			t.Errorf("%s has no SealRun", m)
			continue
		}
		src := seededBytes(r, 4096)
		orig := bytes.Clone(src)
		want := bytes.Clone(src)
		c.Seal(77, want, nil)
		dst := make([]byte, 4096)
		st.SealRun(77, dst, src)
		if !bytes.Equal(dst, want) || !bytes.Equal(src, orig) {
			t.Errorf("%s: SealRun differs from Seal (%v) or changed its source (%v)", m, !bytes.Equal(dst, want), !bytes.Equal(src, orig))
		}
		if msg := lpPanicMsg(func() { st.SealRun(1, dst[:100], src) }); !strings.Contains(msg, "sector size 4096") {
			t.Errorf("%s: short dst: panic %q", m, msg)
		}
		if a := testing.AllocsPerRun(50, func() { st.SealRun(5, dst, src) }); a != 0 {
			t.Errorf("%s SealRun: %v allocations per call", m, a)
		}
	}
}

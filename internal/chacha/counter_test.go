package chacha

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"golang.org/x/crypto/chacha20"
)

// panics runs f and returns the panic message, or "" if it did not panic.
func panics(f func()) (msg string) {
	defer func() {
		if r := recover(); r != nil {
			msg = fmt.Sprint(r)
		}
	}()
	f()
	return ""
}

// TestCounterNearWrap runs the last blocks before 2^32 through every engine and x/crypto,
// in one call and in pieces: a SIMD lane that carried into the nonce word, or a chunk
// that wrapped, would show up here.
func TestCounterNearWrap(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	key, nonce := make([]byte, 32), make([]byte, 12)
	fill(r, key)
	fill(r, nonce)
	for _, e := range engines() {
		for back := uint64(1); back <= 40; back++ {
			ctr := 1<<32 - back
			max := int(back) * BlockSize
			for _, n := range []int{1, 63, 64, 65, max / 2, max - 1, max} {
				if n > max {
					continue
				}
				src := make([]byte, n)
				fill(r, src)
				ref, _ := chacha20.NewUnauthenticatedCipher(key, nonce)
				ref.SetCounter(uint32(ctr))
				want := make([]byte, n)
				ref.XORKeyStream(want, src)

				c := newCipher(t, 20, key, nonce)
				c.eng = e
				c.SetCounter(ctr)
				got := make([]byte, n)
				off := 0
				for _, p := range split(r, n) {
					c.XORKeyStream(got[off:off+p], src[off:off+p])
					off += p
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("%v counter 2^32-%d len %d: first difference at %d", e, back, n, firstDiff(got, want))
				}
			}
		}
	}
}

// TestCounter64Carry checks the 64-bit counter layout across the 2^32 boundary, block by
// block, against blocks computed with the counter words set directly.
func TestCounter64Carry(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(5, 6))
	key, nonce := make([]byte, 32), make([]byte, 8)
	fill(r, key)
	fill(r, nonce)
	const start uint64 = 1<<32 - 21 // 21 blocks below, 59 above the boundary
	const blocks = 80
	want := make([]byte, blocks*BlockSize)
	ref := newCipher(t, 12, key, nonce).st
	for i := 0; i < blocks; i++ {
		ctr := start + uint64(i)
		ref[12], ref[13] = uint32(ctr), uint32(ctr>>32)
		blockGeneric(&ref, 12, (*[BlockSize]byte)(want[i*BlockSize:]))
	}
	for _, e := range engines() {
		for _, n := range []int{64, 1024, 1344, 1345, blocks * BlockSize} {
			c := newCipher(t, 12, key, nonce)
			c.eng = e
			c.SetCounter(start)
			got := make([]byte, n)
			c.XORKeyStream(got, got)
			if !bytes.Equal(got, want[:n]) {
				t.Fatalf("%v len %d: first difference at byte %d (block %d)", e, n, firstDiff(got, want), firstDiff(got, want)/BlockSize)
			}
		}
	}
}

// TestExhaustion pins the documented behaviour at the end of the counter space: the
// block with the largest counter is usable, anything past it panics before writing,
// the same way as x/crypto/chacha20 for the RFC layout, and SetCounter recovers.
func TestExhaustion(t *testing.T) {
	t.Parallel()
	key, nonce12, nonce8, nonce24 := make([]byte, 32), make([]byte, 12), make([]byte, 8), make([]byte, 24)
	type step struct {
		n       int
		panics  bool
		setCtr  bool
		counter uint64
	}
	tests := []struct {
		name  string
		nonce []byte
		steps []step
	}{
		{"last block whole", nonce12, []step{{setCtr: true, counter: 1<<32 - 1}, {n: 64}, {n: 1, panics: true}}},
		{"last block in pieces", nonce12, []step{{setCtr: true, counter: 1<<32 - 1}, {n: 10}, {n: 54}, {n: 1, panics: true}}},
		{"request past the end", nonce12, []step{{setCtr: true, counter: 1<<32 - 2}, {n: 129, panics: true}, {n: 128}, {n: 1, panics: true}}},
		{"large request", nonce12, []step{{setCtr: true, counter: 1<<32 - 40}, {n: 40*64 + 1, panics: true}, {n: 40 * 64}}},
		{"seek back after exhaustion", nonce12, []step{{setCtr: true, counter: 1<<32 - 1}, {n: 64}, {setCtr: true, counter: 5}, {n: 4096}}},
		{"xchacha last block", nonce24, []step{{setCtr: true, counter: 1<<32 - 1}, {n: 63}, {n: 2, panics: true}, {n: 1}, {n: 1, panics: true}}},
		{"64-bit last block", nonce8, []step{{setCtr: true, counter: 1<<64 - 1}, {n: 64}, {n: 1, panics: true}}},
		{"64-bit past the end", nonce8, []step{{setCtr: true, counter: 1<<64 - 3}, {n: 3*64 + 1, panics: true}, {n: 3 * 64}}},
		{"64-bit crosses 2^32", nonce8, []step{{setCtr: true, counter: 1<<32 - 1}, {n: 4096}}},
	}
	for _, tt := range tests {
		for _, e := range engines() {
			t.Run(tt.name+"/"+e.String(), func(t *testing.T) {
				t.Parallel()
				c := newCipher(t, 20, key, tt.nonce)
				c.eng = e
				var ref *chacha20.Cipher
				if len(tt.nonce) != NonceSize64 {
					ref, _ = chacha20.NewUnauthenticatedCipher(key, tt.nonce)
				}
				for i, s := range tt.steps {
					if s.setCtr {
						c.SetCounter(s.counter)
						if ref != nil {
							ref, _ = chacha20.NewUnauthenticatedCipher(key, tt.nonce)
							ref.SetCounter(uint32(s.counter))
						}
						continue
					}
					dst := bytes.Repeat([]byte{0xa5}, s.n)
					msg := panics(func() { c.XORKeyStream(dst, dst) })
					if got := msg != ""; got != s.panics {
						t.Fatalf("step %d (%d bytes): panicked=%v (%q), want %v", i, s.n, got, msg, s.panics)
					}
					if s.panics {
						if !strings.Contains(msg, "exhausted") {
							t.Errorf("step %d: panic %q does not say the keystream is exhausted", i, msg)
						}
						if !bytes.Equal(dst, bytes.Repeat([]byte{0xa5}, s.n)) {
							t.Errorf("step %d: dst was written before the panic", i)
						}
					}
					if ref != nil {
						refDst := bytes.Repeat([]byte{0xa5}, s.n)
						refPanicked := panics(func() { ref.XORKeyStream(refDst, refDst) }) != ""
						if refPanicked != s.panics {
							t.Errorf("step %d: x/crypto panicked=%v, we panicked=%v", i, refPanicked, s.panics)
						}
						if !s.panics && !bytes.Equal(dst, refDst) {
							t.Errorf("step %d: keystream differs from x/crypto", i)
						}
						if refPanicked {
							// x/crypto XORs what is left of a partial block before it
							// panics, so from here its position differs from ours.
							ref = nil
						}
					}
				}
			})
		}
	}
}

func TestSetCounterRange(t *testing.T) {
	t.Parallel()
	c := newCipher(t, 20, make([]byte, 32), make([]byte, 12))
	if msg := panics(func() { c.SetCounter(1 << 32) }); msg == "" {
		t.Error("SetCounter(2^32) on a 32-bit counter did not panic")
	}
	c64 := newCipher(t, 20, make([]byte, 32), make([]byte, 8))
	if msg := panics(func() { c64.SetCounter(1<<64 - 1) }); msg != "" {
		t.Errorf("SetCounter(2^64-1) on a 64-bit counter panicked: %s", msg)
	}
}

// TestSetCounterSeeks checks that SetCounter may move backwards and then repeats the
// keystream exactly, including after a partial block.
func TestSetCounterSeeks(t *testing.T) {
	t.Parallel()
	c := newCipher(t, 8, seq(1, 32), seq(2, 12))
	first := make([]byte, 1000)
	c.XORKeyStream(first, first)
	c.SetCounter(3)
	again := make([]byte, 1000-3*64)
	c.XORKeyStream(again[:7], again[:7])
	c.XORKeyStream(again[7:], again[7:])
	if !bytes.Equal(again, first[3*64:]) {
		t.Fatal("keystream after SetCounter(3) differs from the original from byte 192")
	}
}

func TestOneShotExhaustion(t *testing.T) {
	t.Parallel()
	var key [32]byte
	var nonce [12]byte
	var xnonce [24]byte
	buf := make([]byte, 65)
	if msg := panics(func() { XORKeyStreamAt(20, &key, &nonce, 1<<32-1, buf[:64], buf[:64]) }); msg != "" {
		t.Errorf("last block: %s", msg)
	}
	if msg := panics(func() { XORKeyStreamAt(20, &key, &nonce, 1<<32-1, buf, buf) }); !strings.Contains(msg, "exhausted") {
		t.Errorf("65 bytes at the last block: panic %q, want exhaustion", msg)
	}
	if msg := panics(func() { XORKeyStreamXAt(8, &key, &xnonce, 1<<32-1, buf, buf) }); !strings.Contains(msg, "exhausted") {
		t.Errorf("xchacha, 65 bytes at the last block: panic %q, want exhaustion", msg)
	}
}

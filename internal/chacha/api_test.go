package chacha

import (
	"bytes"
	"crypto/cipher"
	"strings"
	"testing"
)

var _ cipher.Stream = (*Cipher)(nil)

func TestConstructorErrors(t *testing.T) {
	t.Parallel()
	k, n12, n8, n24, n16 := make([]byte, 32), make([]byte, 12), make([]byte, 8), make([]byte, 24), make([]byte, 16)
	tests := []struct {
		name string
		f    func() error
		want string
	}{
		{"rounds 10", func() error { _, err := New(10, k, n12); return err }, "rounds"},
		{"rounds 0", func() error { _, err := NewX(0, k, n24); return err }, "rounds"},
		{"short key", func() error { _, err := New(20, k[:31], n12); return err }, "key must be 32 bytes"},
		{"long key", func() error { _, err := New64(8, append(k, 0), n8); return err }, "key must be 32 bytes"},
		{"nonce 8 for New", func() error { _, err := New(20, k, n8); return err }, "nonce must be 12 bytes"},
		{"nonce 12 for New64", func() error { _, err := New64(20, k, n12); return err }, "nonce must be 8 bytes"},
		{"nonce 12 for NewX", func() error { _, err := NewX(12, k, n12); return err }, "nonce must be 24 bytes"},
		{"hchacha nonce 24", func() error { _, err := HChaCha(20, k, n24); return err }, "nonce must be 16 bytes"},
		{"hchacha rounds 7", func() error { _, err := HChaCha(7, k, n16); return err }, "rounds"},
	}
	for _, tt := range tests {
		err := tt.f()
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: error %v, want one mentioning %q", tt.name, err, tt.want)
		}
	}
}

func TestXORKeyStreamMisuse(t *testing.T) {
	t.Parallel()
	c := newCipher(t, 20, make([]byte, 32), make([]byte, 12))
	buf := make([]byte, 200)
	if msg := panics(func() { c.XORKeyStream(buf[:10], buf[:11]) }); !strings.Contains(msg, "output smaller") {
		t.Errorf("short dst: panic %q", msg)
	}
	if msg := panics(func() { c.XORKeyStream(buf[1:101], buf[:100]) }); !strings.Contains(msg, "overlap") {
		t.Errorf("shifted overlap: panic %q", msg)
	}
	var key [32]byte
	var nonce [12]byte
	if msg := panics(func() { XORKeyStreamAt(20, &key, &nonce, 0, buf[64:164], buf[:100]) }); !strings.Contains(msg, "overlap") {
		t.Errorf("one-shot shifted overlap: panic %q", msg)
	}
	if msg := panics(func() { XORKeyStreamAt(10, &key, &nonce, 0, buf, buf) }); !strings.Contains(msg, "rounds") {
		t.Errorf("one-shot rounds 10: panic %q", msg)
	}
	// A longer dst is fine and only its first len(src) bytes change.
	dst := bytes.Repeat([]byte{1}, 100)
	c.XORKeyStream(dst, make([]byte, 50))
	if !bytes.Equal(dst[50:], bytes.Repeat([]byte{1}, 50)) {
		t.Error("bytes past len(src) were written")
	}
	c.XORKeyStream(nil, nil) // no-op, no panic
}

// TestOneShotNoAlloc: the per-sector entry points must not allocate (the sector codecs
// call them for every sector).
func TestOneShotNoAlloc(t *testing.T) {
	var key [32]byte
	var nonce [12]byte
	var xnonce [24]byte
	for _, n := range []int{100, 512, 4096} {
		buf := make([]byte, n)
		if a := testing.AllocsPerRun(50, func() { XORKeyStreamAt(20, &key, &nonce, 0, buf, buf) }); a != 0 {
			t.Errorf("XORKeyStreamAt(%d bytes): %v allocations", n, a)
		}
		if a := testing.AllocsPerRun(50, func() { XORKeyStreamXAt(12, &key, &xnonce, 0, buf, buf) }); a != 0 {
			t.Errorf("XORKeyStreamXAt(%d bytes): %v allocations", n, a)
		}
	}
	c := newCipher(t, 20, key[:], nonce[:])
	buf := make([]byte, 1000)
	if a := testing.AllocsPerRun(50, func() { c.XORKeyStream(buf, buf) }); a != 0 {
		t.Errorf("Cipher.XORKeyStream: %v allocations", a)
	}
}

func TestImplementation(t *testing.T) {
	t.Parallel()
	got := Implementation()
	es := engines()
	if want := es[len(es)-1].String(); got != want {
		t.Errorf("Implementation() = %q, but the best engine this machine runs is %q", got, want)
	}
}

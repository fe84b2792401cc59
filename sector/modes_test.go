package sector

import "testing"

func TestModes(t *testing.T) {
	t.Parallel()
	valid := map[Mode]bool{}
	for _, m := range Modes() {
		valid[m] = true
		got, err := ParseMode(m.String())
		if err != nil || got != m {
			t.Errorf("ParseMode(%q) = %v, %v", m.String(), got, err)
		}
		if m.Authenticated() != (m.MetaSize() > 0) || (m.Unsafe() && m.Authenticated()) {
			t.Errorf("%v: authenticated %v, meta %d, unsafe %v", m, m.Authenticated(), m.MetaSize(), m.Unsafe())
		}
	}
	for i := 0; i < 256; i++ {
		m := Mode(i)
		if m.Valid() != valid[m] {
			t.Errorf("Mode(%d).Valid() = %v", i, m.Valid())
		}
		if !m.Valid() && (m.KeySize() != 0 || m.MetaSize() != 0 || m.Unsafe() || m.String() == "") {
			t.Errorf("invalid Mode(%d) has properties: %q", i, m.String())
		}
	}
	if Default != ModeXChaCha20Poly1305 || Modes()[0] != Default {
		t.Error("the default mode is not xchacha20-poly1305, first in Modes()")
	}
	for _, bad := range []string{"", "rot13", "aes", "chacha20"} {
		if _, err := ParseMode(bad); err == nil {
			t.Errorf("ParseMode(%q) accepted", bad)
		}
	}
	if m, err := ParseMode(" XChaCha20-Poly1305 "); err != nil || m != ModeXChaCha20Poly1305 {
		t.Errorf("ParseMode is not case- and space-tolerant: %v, %v", m, err)
	}
	// The numbers are on disk: they never change.
	for m, n := range map[Mode]uint8{ModeXChaCha20Poly1305: 1, ModeAESXTS256: 2, ModeAESXTS128: 3, ModeChaCha20XTS: 4, ModeNone: 10} {
		if uint8(m) != n {
			t.Errorf("%v is %d, was %d", m, uint8(m), n)
		}
	}
}

func BenchmarkModeMetaSize(b *testing.B) {
	m := ModeXChaCha20Poly1305
	n := 0
	for b.Loop() {
		n += m.MetaSize()
	}
	_ = n
}

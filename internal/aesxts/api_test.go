package aesxts

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestNewKeySizes(t *testing.T) {
	t.Parallel()
	for _, n := range []int{0, 16, 24, 31, 33, 48, 63, 65, 128} {
		if _, err := New(make([]byte, n)); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d bytes", n)) {
			t.Errorf("New(%d-byte key): %v, want an error naming the length", n, err)
		}
	}
	for n, rounds := range map[int]int{32: 10, 64: 14} {
		c, err := New(make([]byte, n))
		if err != nil || c.rounds != rounds || c.e != defaultEngine {
			t.Errorf("New(%d-byte key) = %v rounds, engine %v, %v", n, c.rounds, c.e, err)
		}
	}
}

func TestImplementation(t *testing.T) {
	t.Parallel()
	es := engines()
	if got := Implementation(); got != es[len(es)-1].String() {
		t.Errorf("Implementation() = %q, want the fastest engine here, %q", got, es[len(es)-1])
	}
	if es[0] != engineGeneric {
		t.Errorf("engines() = %v, want generic first", es)
	}
}

func panicMsg(f func()) (msg string) {
	defer func() {
		if r := recover(); r != nil {
			msg = fmt.Sprint(r)
		}
	}()
	f()
	return ""
}

// TestMisuse: every engine panics, before writing anything, on lengths that are not
// whole units, short outputs and shifted overlaps, and after Wipe.
func TestMisuse(t *testing.T) {
	t.Parallel()
	for _, e := range engines() {
		c := mustCipher(t, bytes.Repeat([]byte{1, 2}, 32), e)
		buf := make([]byte, 4096+64)
		for i := range buf {
			buf[i] = byte(i)
		}
		orig := bytes.Clone(buf)
		tests := []struct {
			name string
			f    func()
			want string
		}{
			{"partial block", func() { c.Encrypt(buf[:100], buf[:100], 0) }, "not a whole number of 16-byte units"},
			{"partial block dec", func() { c.Decrypt(buf[:15], buf[:15], 0) }, "not a whole number of 16-byte units"},
			{"short dst", func() { c.Encrypt(buf[:16], buf[32:64], 0) }, "shorter than"},
			{"shifted overlap", func() { c.Encrypt(buf[16:80], buf[:64], 0) }, "overlap"},
			{"shifted overlap dec", func() { c.Decrypt(buf[:64], buf[1:65], 0) }, "overlap"},
			{"sector size 0", func() { c.EncryptSectors(buf[:512], buf[:512], 0, 0) }, "not a positive multiple of 16"},
			{"sector size 24", func() { c.EncryptSectors(buf[:48], buf[:48], 24, 0) }, "not a positive multiple of 16"},
			{"partial sector", func() { c.EncryptSectors(buf[:700], buf[:700], 512, 0) }, "not a whole number of 512-byte units"},
			{"short run dst", func() { c.DecryptSectors(buf[:512], buf[1024:2048], 512, 0) }, "shorter than"},
			{"run overlap", func() { c.DecryptSectors(buf[512:1536], buf[:1024], 512, 0) }, "overlap"},
		}
		for _, tt := range tests {
			if msg := panicMsg(tt.f); !strings.Contains(msg, tt.want) {
				t.Errorf("%v %s: panic %q, want one mentioning %q", e, tt.name, msg, tt.want)
			}
		}
		if !bytes.Equal(buf, orig) {
			t.Errorf("%v: a rejected call wrote to its buffers", e)
		}
		// Nothing to do is not an error, and a longer dst is fine (only len(src) is written).
		c.Encrypt(nil, nil, 0)
		c.EncryptSectors(buf[:0], buf[:0], 512, 0)
		c.Encrypt(buf[:64], buf[64:96], 7)
		if !bytes.Equal(buf[32:], orig[32:]) {
			t.Errorf("%v: Encrypt wrote past len(src) into a longer dst", e)
		}

		c.Wipe()
		if c.enc != (schedule{}) || c.dec != (schedule{}) || c.tweak != (schedule{}) || c.ref != nil {
			t.Errorf("%v: Wipe left key material", e)
		}
		for name, f := range map[string]func(){
			"Encrypt":        func() { c.Encrypt(buf[:16], buf[:16], 0) },
			"Decrypt":        func() { c.Decrypt(buf[:16], buf[:16], 0) },
			"EncryptSectors": func() { c.EncryptSectors(buf[:512], buf[:512], 512, 0) },
			"DecryptSectors": func() { c.DecryptSectors(buf[:512], buf[:512], 512, 0) },
		} {
			if msg := panicMsg(f); !strings.Contains(msg, "after Wipe") {
				t.Errorf("%v %s after Wipe: panic %q", e, name, msg)
			}
		}
	}
}

// TestKeysDiffer: the halves are used as data key and tweak key, in that order, and a
// changed bit anywhere in the key changes the output.
func TestKeysDiffer(t *testing.T) {
	t.Parallel()
	for _, e := range engines() {
		for _, n := range []int{32, 64} {
			key := make([]byte, n)
			for i := range key {
				key[i] = byte(i + 1)
			}
			base := make([]byte, 512)
			mustCipher(t, key, e).Encrypt(base, make([]byte, 512), 3)
			seen := [][]byte{base}
			for _, bit := range []int{0, 8*n/2 - 1, 8 * n / 2, 8*n - 1} {
				k := bytes.Clone(key)
				k[bit/8] ^= 1 << (bit % 8)
				out := make([]byte, 512)
				mustCipher(t, k, e).Encrypt(out, make([]byte, 512), 3)
				if slices.ContainsFunc(seen, func(s []byte) bool { return bytes.Equal(s, out) }) {
					t.Errorf("%v %d-byte key: flipping bit %d does not change the output", e, n, bit)
				}
				seen = append(seen, out)
			}
		}
	}
}

// TestNoAllocs: the calls run once per sector or run and must not allocate (not
// parallel: AllocsPerRun forbids it).
func TestNoAllocs(t *testing.T) {
	for _, e := range engines() {
		if e == engineGeneric && raceEnabled {
			t.Logf("%v: x/crypto/xts's sync.Pool allocates under -race", e)
			continue
		}
		c := mustCipher(t, make([]byte, 64), e)
		buf := make([]byte, 64<<10)
		index := uint64(0)
		for name, f := range map[string]func(){
			"Encrypt":        func() { index++; c.Encrypt(buf[:4096], buf[:4096], index) },
			"Decrypt":        func() { index++; c.Decrypt(buf[:512], buf[:512], index) },
			"EncryptSectors": func() { index += 128; c.EncryptSectors(buf, buf, 512, index) },
			"DecryptSectors": func() { index += 16; c.DecryptSectors(buf, buf, 4096, index) },
		} {
			if a := testing.AllocsPerRun(20, f); a != 0 {
				t.Errorf("%v %s: %v allocations per call", e, name, a)
			}
		}
	}
}

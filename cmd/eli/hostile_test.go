package main

import (
	"crypto/sha256"
	"encoding/binary"
	"os"
	"strings"
	"testing"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
)

// setSlotKDF rewrites keyslot slot's Argon2id parameters in both header copies of the
// provider at path and fixes their checksums, as whoever hands over a provider can. The
// byte offsets are docs/format.md's ("Keyslot" at 128 + 192·i: lanes at 3, passes at 4,
// memory in KiB at 8; the checksum is SHA-256 of bytes 0..4063 at 4064).
func setSlotKDF(t *testing.T, path string, slot int, passes, memKiB uint32, lanes uint8) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, layout.HeaderBOffset(st.Size())} {
		b := make([]byte, keys.HeaderSize)
		if _, err := f.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		s := b[128+192*slot:]
		s[3] = lanes
		binary.LittleEndian.PutUint32(s[4:], passes)
		binary.LittleEndian.PutUint32(s[8:], memKiB)
		sum := sha256.Sum256(b[:4064])
		copy(b[4064:], sum[:])
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
}

// A header that asks for the format's largest Argon2id cost (4 GiB × 1000 passes × 255
// lanes, hours of work) is refused before any derivation by every command that unlocks,
// with a message naming the limit and the override. A derivation would outlast the test's
// timeout, so the commands returning at all shows none was run.
func TestHostileKDFHeader(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("hostile.img", "16M")
	setSlotKDF(t, img, 0, keys.MaxKDFTime, keys.MaxKDFMemoryKiB, 255)
	if d := e.OK("dump", img).Stdout; !containsAll(d, "t=1000", "p=255") {
		t.Fatalf("the crafted header does not decode as crafted:\n%s", d)
	}
	for _, args := range [][]string{
		{"attach", "--passphrase-file", e.Pass, img},
		{"attach", "--slot", "0", "--passphrase-file", e.Pass, img},
		{"setkey", "--passphrase-file", e.Pass, "--new-passphrase-file", e.Pass, img},
		{"resize", "--passphrase-file", e.Pass, "--size", "32M", img},
	} {
		e.FailsCode(1, "more than the limit of", args...)
		e.FailsCode(1, "--kdf-allow-expensive", args...)
	}

	// Within the format but over the lane limit only: the override lets it through
	// (the slot's parameters are in its AD, so it then fails as a wrong key, after a
	// cheap derivation).
	setSlotKDF(t, img, 0, 1, 8*64, 64)
	e.FailsCode(1, "more than the limit of 16 lanes", "attach", "--passphrase-file", e.Pass, img)
	e.FailsCode(1, "wrong passphrase", "attach", "--kdf-allow-expensive", "--passphrase-file", e.Pass, img)
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

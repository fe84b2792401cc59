package keys

import (
	"crypto/hkdf"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"testing"

	"github.com/elidisk/eli/internal/memscan"
	"github.com/elidisk/eli/sector"
	"golang.org/x/sys/unix"
)

// patterns holds the byte strings a memory scan looks for, in a mapping of its own that
// memscan does not report (its patterns) and that nothing else writes to.
type patterns struct {
	mem  []byte
	used int
	list [][]byte
	name []string
}

func newPatterns(t *testing.T) *patterns {
	t.Helper()
	m, err := unix.Mmap(-1, 0, 4*os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	return &patterns{mem: m}
}

// add copies b, XORed with x, a byte at a time (copy would pass it through vector
// registers, which a signal can save where a scan finds them: see memscan.Scan).
//
//go:noinline
func (p *patterns) add(name string, b []byte, x byte) {
	dst := p.mem[p.used : p.used+len(b) : p.used+len(b)]
	for i := range b {
		dst[i] = b[i] ^ x
	}
	p.used += len(b) + 8 // a gap, so that adjacent patterns do not form another one
	p.list = append(p.list, dst)
	p.name = append(p.name, name)
}

// TestDerivedKeysLeaveNoCopy derives every key of a volume from a master key, finds each
// in this process's memory (so that the scan can fail), wipes them, and then finds no copy
// of any of them, nor of the key-equivalent values the derivation computes (the HKDF PRK,
// the header-MAC key's HMAC pads), in any writable mapping. With crypto/hkdf and
// crypto/hmac, the journal and header-MAC keys were found after their wipe, in the heap
// memory of crypto/hkdf's output blocks.
func TestDerivedKeysLeaveNoCopy(t *testing.T) {
	mk, err := GenerateMasterKey()
	if err != nil {
		t.Fatal(err)
	}
	live := map[string]*Secret{
		"master":     mk.key,
		"data-xts":   mk.DataKey(sector.ModeAESXTS256),
		"data-aead":  mk.DataKey(sector.ModeXChaCha20Poly1305),
		"journal":    mk.JournalKey(),
		"header-mac": mk.headerMACKey(),
	}
	var raw [HeaderSize]byte
	mac := headerMAC(&raw, mk)

	p := newPatterns(t)
	for _, name := range []string{"master", "data-xts", "data-aead", "journal", "header-mac"} {
		p.add(name, live[name].Bytes(), 0)
	}
	xts := live["data-xts"].Bytes()
	p.add("data-xts first half", xts[:32], 0)
	p.add("data-xts second half", xts[32:], 0)
	p.add("header-mac ipad", live["header-mac"].Bytes(), 0x36)
	p.add("header-mac opad", live["header-mac"].Bytes(), 0x5c)
	k := newKeyedHash()
	prk := NewSecret(hmacSize)
	id := mk.VolumeID()
	k.sum(prk.Bytes(), id[:], mk.Bytes())
	k.wipe()
	p.add("prk", prk.Bytes(), 0)
	p.add("prk ipad", prk.Bytes(), 0x36)
	prk.Wipe()
	named := len(live) // the patterns that are live Secrets until the wipe

	before, err := memscan.Scan(0, p.list...)
	if err != nil {
		t.Fatal(err)
	}
	for i := range named {
		if !before.Found(i) {
			t.Errorf("the %s key was not found while it was live: the scan cannot see it", p.name[i])
		}
	}
	for _, s := range live {
		s.Wipe()
	}
	after, err := memscan.Scan(0, p.list...)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range after.Matches {
		t.Errorf("%s found after the wipe: %v", p.name[m.Pattern], m)
	}
	if len(after.Unreadable) > 0 {
		t.Logf("unreadable: %v", after.Unreadable)
	}
	_ = mac
}

// TestHKDFSHA256 checks the HKDF here against RFC 5869's first SHA-256 test case and
// against crypto/hkdf for the lengths eli derives and past two blocks.
func TestHKDFSHA256(t *testing.T) {
	ikm, _ := hex.DecodeString("0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b")
	salt, _ := hex.DecodeString("000102030405060708090a0b0c")
	info, _ := hex.DecodeString("f0f1f2f3f4f5f6f7f8f9")
	out := make([]byte, 42)
	hkdfSHA256(out, ikm, salt, string(info))
	if got := hex.EncodeToString(out); got != "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865" {
		t.Errorf("RFC 5869 A.1: OKM %s", got)
	}
	for _, n := range []int{1, 31, 32, 33, 64, 65, 100} {
		for _, salt := range [][]byte{nil, []byte("volume-id-16byte")} {
			want, err := hkdf.Key(sha256.New, ikm, salt, "eli/v1/test", n)
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, n)
			hkdfSHA256(got, ikm, salt, "eli/v1/test")
			if string(got) != string(want) {
				t.Errorf("%d bytes, salt %q: %x, crypto/hkdf gives %x", n, salt, got, want)
			}
		}
	}
}

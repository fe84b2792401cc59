package keys

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"os"
	"testing"

	"github.com/elidisk/eli/sector"
)

var updateGolden = flag.Bool("update", false, "rewrite keys/testdata/header-v1.bin")

const goldenPath = "testdata/header-v1.bin"

// The golden volume: testLayout on a 4 MiB provider, every random byte from
// countingReader (volume ID 00..0f, master key 10..4f, then salts and nonces), slot 0 a
// passphrase, slot 3 passphrase and two keyfiles, slot 7 one keyfile.
var goldenSlots = []struct {
	slot int
	c    Credentials
	kdf  KDFParams
}{
	{0, pass("golden passphrase"), KDFParams{Time: 1, MemoryKiB: 64, Threads: 1}},
	{3, Credentials{Passphrase: []byte("golden passphrase 3"), Keyfiles: [][]byte{[]byte("keyfile A"), []byte("keyfile B")}}, KDFParams{Time: 2, MemoryKiB: 128, Threads: 2}},
	{7, Credentials{Keyfiles: [][]byte{[]byte("keyfile C")}}, KDFParams{Time: 3, MemoryKiB: 32, Threads: 4}},
}

func buildGolden(t *testing.T) []byte {
	t.Helper()
	rnd := &countingReader{}
	p := newMem(testSize)
	mk, err := create(p, testLayout(), goldenSlots[0].c, goldenSlots[0].kdf, rnd)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	for _, s := range goldenSlots[1:] {
		if _, err := setKey(p, mk, s.slot, s.c, s.kdf, rnd); err != nil {
			t.Fatal(err)
		}
	}
	return p.bytesAt(0, HeaderSize)
}

// Vectors computed outside Go, so the golden header pins the format, not this code:
//
//	ikm:  python3 hashlib.sha512(b"eli-kdf-v1" + (17).to_bytes(4, "little") +
//	      b"golden passphrase" + (0).to_bytes(4, "little")).hexdigest()
//	keys: openssl kdf -keylen N -kdfopt digest:SHA256 -kdfopt hexkey:<10..4f>
//	      -kdfopt hexsalt:<00..0f> -kdfopt info:eli/v1/... HKDF
const (
	goldenIKM        = "7a99977ce302211b552be64fb69cf6d26e5a70179fcb0a4664ce32dcdd9385b89a5cf3d6733cdb7902e5034f78d7f4f32c35d35ab8c92c88054683681efd3579"
	goldenDataKey    = "5473a2ff0b542fc1c9145fd80ad5c6dad230b69d261c4526fde99b22f21e729f"
	goldenJournalKey = "0a28d8ef7715fedb30695f837d7f69200da2e6a3924d8739f203e07cff6840e5"
	goldenMACKey     = "d0fcb1f6a5639d60d787445e100eb70cb00687f2670c74fc4b4de7d42fb57418"
)

func TestGoldenHeader(t *testing.T) {
	t.Parallel()
	built := buildGolden(t)
	if *updateGolden {
		if err := os.WriteFile(goldenPath, built, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	golden, err := os.ReadFile(goldenPath)
	if err != nil {
		t.Fatalf("%v (run go test ./keys -run TestGoldenHeader -update to create it)", err)
	}
	if !bytes.Equal(built, golden) {
		t.Fatalf("the header this code writes differs from %s: a format change must be deliberate (bump the version, then -update)", goldenPath)
	}

	h, err := Decode(golden)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	wantID := [16]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
	if h.Layout != testLayout() || h.VolumeID != wantID || h.Sequence != 3 || h.ProviderSize != testSize || h.ActiveSlots() != 3 {
		t.Errorf("decoded %+v", h)
	}
	wantMK := make([]byte, MasterKeySize)
	for i := range wantMK {
		wantMK[i] = byte(16 + i)
	}
	for _, s := range goldenSlots {
		if info := h.Slots[s.slot]; !info.Active || info.KDF != s.kdf || info.Uses != s.c.Uses() {
			t.Errorf("slot %d = %+v", s.slot, info)
		}
		mk, slot, err := h.Unlock(s.c, AnySlot)
		if err != nil || slot != s.slot {
			t.Fatalf("Unlock slot %d: %d, %v", s.slot, slot, err)
		}
		if !bytes.Equal(mk.Bytes(), wantMK) {
			t.Errorf("slot %d unwraps another master key", s.slot)
		}
		mk.Wipe()
	}

	ikm := goldenSlots[0].c.ikm()
	if got := hex.EncodeToString(ikm.Bytes()); got != goldenIKM {
		t.Errorf("ikm = %s, want %s", got, goldenIKM)
	}
	ikm.Wipe()
	mk, err := NewMasterKey(wantID, wantMK)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	for _, k := range []struct {
		name string
		s    *Secret
		want string
	}{
		{"data", mk.DataKey(sector.ModeXChaCha20Poly1305), goldenDataKey},
		{"journal", mk.JournalKey(), goldenJournalKey},
		{"header-mac", mk.headerMACKey(), goldenMACKey},
	} {
		if got := hex.EncodeToString(k.s.Bytes()); got != k.want {
			t.Errorf("%s key = %s, want %s", k.name, got, k.want)
		}
		k.s.Wipe()
	}
	// The MAC is HMAC-SHA256 over bytes [0, 96) with the sequence zeroed.
	macKey, _ := hex.DecodeString(goldenMACKey)
	m := hmac.New(sha256.New, macKey)
	covered := bytes.Clone(golden[:offMAC])
	clear(covered[offSequence : offSequence+8])
	m.Write(covered)
	if !bytes.Equal(m.Sum(nil), golden[offMAC:offMAC+macSize]) {
		t.Error("the golden header's MAC is not HMAC-SHA256(header-mac key, bytes [0, 96) with the sequence zeroed)")
	}
}

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

	"golang.org/x/crypto/chacha20poly1305"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden headers in keys/testdata")

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
	p, mk, _ := buildGoldenVolume(t)
	mk.Wipe()
	return p.bytesAt(0, HeaderSize)
}

// buildGoldenVolume makes the golden volume and returns it with its master key and the
// random source, for what follows it.
func buildGoldenVolume(t *testing.T) (*memProvider, *MasterKey, *countingReader) {
	t.Helper()
	rnd := &countingReader{}
	p := newMem(testSize)
	mk, err := create(p, testLayout(), goldenSlots[0].c, goldenSlots[0].kdf, rnd)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range goldenSlots[1:] {
		if _, err := setKey(p, mk, s.slot, s.c, s.kdf, rnd); err != nil {
			t.Fatal(err)
		}
	}
	return p, mk, rnd
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

const goldenReencPath = "testdata/header-v1-reencrypting.bin"

// Vectors for the golden header caught halfway through a re-encryption, computed outside
// Go (python3 hmac/hashlib HKDF-SHA256, as for the keys above): the new master key is the
// counting source's bytes 08..47 (what follows the golden volume's salts and nonces and a
// volume ID that the new key does not take).
const (
	goldenNewMK       = "08090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f4041424344454647"
	goldenPreviousKEK = "7f82a6fb9e20db7d3e9a81794c498dccb3f7f4db6b064a42c210279d35e0555e"
	goldenNewMACKey   = "3582f18ea637ddbeee08ed938cbd2e54dda0daebae758517fa0d3b856f60edd4"
	goldenReencCursor = 123
)

// TestGoldenHeaderReencrypting pins the header of a volume caught halfway through a
// re-encryption (docs/format.md, "Re-encryption"): the golden volume, re-encrypted with
// every keyslot kept, checkpointed at sector 123. An independent reader opens the
// previous key with the KEK and additional data the format describes.
func TestGoldenHeaderReencrypting(t *testing.T) {
	t.Parallel()
	p, old, rnd := buildGoldenVolume(t)
	defer old.Wipe()
	slots := map[int]Credentials{}
	for _, s := range goldenSlots {
		slots[s.slot] = s.c
	}
	mk, err := beginReencrypt(p, old, ReencryptOptions{Slots: slots}, rnd)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	if err := setReencryptCursor(p, mk, goldenReencCursor, rnd); err != nil {
		t.Fatal(err)
	}
	built := p.bytesAt(0, HeaderSize)
	if *updateGolden {
		if err := os.WriteFile(goldenReencPath, built, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	golden, err := os.ReadFile(goldenReencPath)
	if err != nil {
		t.Fatalf("%v (run go test ./keys -run TestGoldenHeader -update to create it)", err)
	}
	if !bytes.Equal(built, golden) {
		t.Fatalf("the header this code writes differs from %s: a format change must be deliberate (then -update)", goldenReencPath)
	}
	h, err := Decode(golden)
	if err != nil {
		t.Fatal(err)
	}
	if r := h.Reencryption(); r != (Reencryption{Epoch: 1, Active: true, PrevMode: sector.ModeXChaCha20Poly1305, Cursor: goldenReencCursor}) {
		t.Fatalf("state %+v", r)
	}
	wantNew, _ := hex.DecodeString(goldenNewMK)
	for _, s := range goldenSlots {
		got, _, err := h.Unlock(s.c, AnySlot)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Bytes(), wantNew) {
			t.Errorf("slot %d unwraps another key than the new one", s.slot)
		}
		got.Wipe()
	}
	// Independently of this package: the header MAC under the new key covers the epoch,
	// and the previous key opens with XChaCha20-Poly1305 under HKDF(new key,
	// "eli/v1/previous-key") with AD = bytes [0, 80) (sequence zeroed) ‖ bytes [1664, 1688).
	macKey, _ := hex.DecodeString(goldenNewMACKey)
	m := hmac.New(sha256.New, macKey)
	covered := bytes.Clone(golden[:offMAC])
	clear(covered[offSequence : offSequence+8])
	m.Write(covered)
	m.Write(golden[1664:1672])
	if !bytes.Equal(m.Sum(nil), golden[offMAC:offMAC+macSize]) {
		t.Error("the header MAC is not HMAC-SHA256(header-mac key, bytes [0, 96) with the sequence zeroed ‖ the epoch)")
	}
	kek, _ := hex.DecodeString(goldenPreviousKEK)
	aead, err := chacha20poly1305.NewX(kek)
	if err != nil {
		t.Fatal(err)
	}
	ad := bytes.Clone(golden[:80])
	clear(ad[offSequence : offSequence+8])
	ad = append(ad, golden[1664:1688]...)
	prev, err := aead.Open(nil, golden[1688:1712], golden[1712:1792], ad)
	if err != nil {
		t.Fatalf("the previous key does not open as the format says: %v", err)
	}
	for i, b := range prev {
		if b != byte(16+i) {
			t.Fatal("the previous key is not the golden master key")
		}
	}
}

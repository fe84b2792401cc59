package poly1305

import (
	"bytes"
	"encoding/hex"
	"strings"
	"testing"

	"golang.org/x/crypto/chacha20"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatalf("bad hex in a test vector: %v", err)
	}
	return b
}

func key32(t *testing.T, s string) *[32]byte {
	t.Helper()
	var k [32]byte
	if b := unhex(t, s); copy(k[:], b) != 32 || len(b) != 32 {
		t.Fatalf("key %q is not 32 bytes", s)
	}
	return &k
}

const ietfContribution = "Any submission to the IETF intended by the Contributor for publication " +
	"as all or part of an IETF Internet-Draft or RFC and any statement made within the " +
	"context of an IETF activity is considered an \"IETF Contribution\". Such statements " +
	"include oral statements in IETF sessions, as well as written and electronic " +
	"communications made at any time or place, which are addressed to"

const jabberwocky = "'Twas brillig, and the slithy toves\nDid gyre and gimble in the wabe:\n" +
	"All mimsy were the borogoves,\nAnd the mome raths outgrabe."

// TestRFC8439Vectors: RFC 8439 §2.5.2 and the eleven Poly1305 vectors of §A.3, on every
// path, as raw messages.
func TestRFC8439Vectors(t *testing.T) {
	t.Parallel()
	if len(ietfContribution) != 375 || len(jabberwocky) != 127 {
		t.Fatalf("vector texts have %d and %d bytes, RFC 8439 §A.3 says 375 and 127",
			len(ietfContribution), len(jabberwocky))
	}
	ff := strings.Repeat("ff", 16)
	tests := []struct{ name, key, msg, tag string }{
		{"2.5.2", "85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b",
			hex.EncodeToString([]byte("Cryptographic Forum Research Group")),
			"a8061dc1305136c6c22b8baf0c0127a9"},
		{"A.3#1", strings.Repeat("00", 32), strings.Repeat("00", 64), strings.Repeat("00", 16)},
		{"A.3#2", strings.Repeat("00", 16) + "36e5f6b5c5e06070f0efca96227a863e",
			hex.EncodeToString([]byte(ietfContribution)), "36e5f6b5c5e06070f0efca96227a863e"},
		{"A.3#3", "36e5f6b5c5e06070f0efca96227a863e" + strings.Repeat("00", 16),
			hex.EncodeToString([]byte(ietfContribution)), "f3477e7cd95417af89a6b8794c310cf0"},
		{"A.3#4", "1c9240a5eb55d38af333888604f6b5f0473917c1402b80099dca5cbc207075c0",
			hex.EncodeToString([]byte(jabberwocky)), "4541669a7eaaee61e708dc7cbcc5eb62"},
		{"A.3#5", "02" + strings.Repeat("00", 31), ff, "03" + strings.Repeat("00", 15)},
		{"A.3#6", "02" + strings.Repeat("00", 15) + ff, "02" + strings.Repeat("00", 15),
			"03" + strings.Repeat("00", 15)},
		{"A.3#7", "01" + strings.Repeat("00", 31),
			ff + "f0" + strings.Repeat("ff", 15) + "11" + strings.Repeat("00", 15),
			"05" + strings.Repeat("00", 15)},
		{"A.3#8", "01" + strings.Repeat("00", 31),
			ff + "fb" + strings.Repeat("fe", 15) + strings.Repeat("01", 16), strings.Repeat("00", 16)},
		{"A.3#9", "02" + strings.Repeat("00", 31), "fd" + strings.Repeat("ff", 15),
			"fa" + strings.Repeat("ff", 15)},
		{"A.3#10", "01000000000000000400000000000000" + strings.Repeat("00", 16),
			"e33594d7505e43b90000000000000000" + "3394d7505e4379cd0100000000000000" +
				strings.Repeat("00", 16) + "01000000000000000000000000000000",
			"14000000000000005500000000000000"},
		{"A.3#11", "01000000000000000400000000000000" + strings.Repeat("00", 16),
			"e33594d7505e43b90000000000000000" + "3394d7505e4379cd0100000000000000" +
				strings.Repeat("00", 16),
			"13000000000000000000000000000000"},
	}
	for _, p := range paths() {
		for _, tc := range tests {
			var tag [16]byte
			sumRaw(p, &tag, key32(t, tc.key), unhex(t, tc.msg))
			if want := unhex(t, tc.tag); !bytes.Equal(tag[:], want) {
				t.Errorf("%v, RFC 8439 %s: tag %x, want %x", p, tc.name, tag, want)
			}
		}
	}
}

// TestRFC8439AEADVector: the tag of RFC 8439 §2.8.2's AEAD example through SumAEAD, its
// one-time key made as §2.6 says (the first 32 bytes of ChaCha20 block 0).
func TestRFC8439AEADVector(t *testing.T) {
	t.Parallel()
	key := unhex(t, "808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f")
	nonce := unhex(t, "070000004041424344454647")
	ad := unhex(t, "50515253c0c1c2c3c4c5c6c7")
	ct := unhex(t, "d31a8d34648e60db7b86afbc53ef7ec2a4aded51296e08fea9e2b5a736ee62d6"+
		"3dbea45e8ca9671282fafb69da92728b1a71de0a9e060b2905d6a5b67ecd3b36"+
		"92ddbd7f2d778b8c9803aee328091b58fab324e4fad675945585808b4831d7bc"+
		"3ff4def08e4b7a9de576d26586cec64b6116")
	want := unhex(t, "1ae10b594f09e26a7e902ecbd0600691")
	c, err := chacha20.NewUnauthenticatedCipher(key, nonce)
	if err != nil {
		t.Fatal(err)
	}
	var polyKey [32]byte
	c.XORKeyStream(polyKey[:], polyKey[:])
	for _, p := range paths() {
		var tag [16]byte
		sumAEAD(p, &tag, &polyKey, ad, ct)
		if !bytes.Equal(tag[:], want) {
			t.Errorf("%v: tag %x, want %x", p, tag, want)
		}
	}
}

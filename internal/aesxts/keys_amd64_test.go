//go:build amd64 && !purego

package aesxts

import (
	"encoding/hex"
	"testing"

	"golang.org/x/sys/cpu"
)

// TestExpandKeyFIPS197 checks expandKeyAESNI against the key expansion examples of
// FIPS-197 Appendix A.1 (AES-128) and A.3 (AES-256): a few round keys, big-endian words
// w[4i..4i+3] in the standard's notation, which are the round key's bytes in order.
func TestExpandKeyFIPS197(t *testing.T) {
	if !cpu.X86.HasAES {
		t.Skip("no AES-NI on this CPU")
	}
	tests := []struct {
		key    string
		rounds int
		want   map[int]string // round -> round key
	}{
		{"2b7e151628aed2a6abf7158809cf4f3c", 10, map[int]string{
			1:  "a0fafe1788542cb123a339392a6c7605",
			10: "d014f9a8c9ee2589e13f0cc8b6630ca6",
		}},
		{"603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4", 14, map[int]string{
			2:  "9ba354118e6925afa51a8b5f2067fcde",
			14: "fe4890d1e6188d0b046df344706c631e",
		}},
	}
	for _, tt := range tests {
		key, _ := hex.DecodeString(tt.key)
		var enc, dec schedule
		expandKeyAESNI(&key[0], tt.rounds, &enc, &dec)
		if got := hex.EncodeToString(enc[:16]); got != tt.key[:32] {
			t.Errorf("AES-%d round key 0 = %s, want the key's first 16 bytes", 32*tt.rounds-192, got)
		}
		for r, want := range tt.want {
			if got := hex.EncodeToString(enc[16*r : 16*r+16]); got != want {
				t.Errorf("AES-%d round key %d = %s, want %s", 32*tt.rounds-192, r, got, want)
			}
		}
		// The equivalent inverse cipher starts with the last round key and ends with
		// the first, both unchanged (FIPS-197 §5.3.5).
		if string(dec[:16]) != string(enc[16*tt.rounds:16*tt.rounds+16]) || string(dec[16*tt.rounds:16*tt.rounds+16]) != string(enc[:16]) {
			t.Errorf("AES-%d decryption schedule does not start and end with the last and first round keys", 32*tt.rounds-192)
		}
		// Nothing past the last round key is written.
		for _, b := range enc[16*(tt.rounds+1):] {
			if b != 0 {
				t.Fatalf("AES-%d: bytes written past round key %d", 32*tt.rounds-192, tt.rounds)
			}
		}
	}
}

package wipe

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"testing"

	"golang.org/x/crypto/chacha20poly1305"
)

func TestAEADKey(t *testing.T) {
	key := make([]byte, 32)
	rand.Read(key)
	for name, mk := range map[string]func([]byte) (cipher.AEAD, error){
		"chacha20poly1305":  chacha20poly1305.New,
		"xchacha20poly1305": chacha20poly1305.NewX,
	} {
		a, err := mk(key)
		if err != nil {
			t.Fatal(err)
		}
		nonce := make([]byte, a.NonceSize())
		sealed := a.Seal(nil, nonce, []byte("sector"), nil)
		if !AEADKey(a) {
			t.Fatalf("%s: x/crypto no longer has a key [32]byte field: keys cannot be wiped", name)
		}
		if _, err := a.Open(nil, nonce, sealed, nil); err == nil {
			t.Fatalf("%s: still opens after its key was wiped", name)
		}
		zero, _ := mk(make([]byte, 32))
		if _, err := zero.Open(nil, nonce, a.Seal(nil, nonce, []byte("x"), nil), nil); err != nil {
			t.Fatalf("%s: the wiped key is not all zero", name)
		}
	}
	// Anything else is left alone and reported.
	block, _ := aes.NewCipher(key)
	gcm, _ := cipher.NewGCM(block)
	if AEADKey(gcm) {
		t.Fatal("claimed to wipe an AES-GCM key it cannot reach")
	}
}

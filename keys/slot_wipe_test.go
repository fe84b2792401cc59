package keys

import (
	"bytes"
	"crypto/cipher"
	"testing"

	"golang.org/x/crypto/chacha20poly1305"
)

// sealWith seals a fixed message under a.
func sealWith(a cipher.AEAD) []byte {
	nonce := make([]byte, chacha20poly1305.NonceSizeX)
	return a.Seal(nil, nonce, []byte("the master key"), []byte("ad"))
}

func zeroKeySeal(t *testing.T) []byte {
	t.Helper()
	z, err := chacha20poly1305.NewX(make([]byte, chacha20poly1305.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	return sealWith(z)
}

// The AEAD that withKEK hands out is wiped when withKEK returns, and works until then.
func TestWithKEKWipesTheAEAD(t *testing.T) {
	t.Parallel()
	ikm := secretFrom(bytes.Repeat([]byte{1}, 64))
	defer ikm.Wipe()
	var kept cipher.AEAD
	var during []byte
	err := withKEK(tiny, ikm, make([]byte, saltSize), func(a cipher.AEAD) error {
		kept, during = a, sealWith(a)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	zero := zeroKeySeal(t)
	if bytes.Equal(during, zero) {
		t.Fatal("the AEAD was wiped before fn ran")
	}
	if !bytes.Equal(sealWith(kept), zero) {
		t.Fatal("the AEAD outlives withKEK with its key")
	}
}

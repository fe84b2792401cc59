package chacha

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"golang.org/x/crypto/chacha20"
)

// aeadRef is XAEADKeys and XORKeyStreamSubkeys built from x/crypto: per message,
// HChaCha20 for the subkey, then x/crypto's ChaCha20 with nonce 0⁴ ‖ nonce[16:24] from
// block 0, whose first 32 bytes are the Poly1305 key and whose blocks 1.. encrypt the
// message.
func aeadRef(t testing.TB, key *[KeySize]byte, nonces, src []byte) (subkeys, polyKeys, dst []byte) {
	t.Helper()
	n := len(nonces) / NonceSizeX
	m := 0
	if n > 0 {
		m = len(src) / n
	}
	for i := range n {
		nonce := nonces[i*NonceSizeX : (i+1)*NonceSizeX]
		sub, err := chacha20.HChaCha20(key[:], nonce[:16])
		if err != nil {
			t.Fatal(err)
		}
		subkeys = append(subkeys, sub...)
		c, err := chacha20.NewUnauthenticatedCipher(sub, append(make([]byte, 4), nonce[16:]...))
		if err != nil {
			t.Fatal(err)
		}
		var block0 [64]byte
		c.XORKeyStream(block0[:], block0[:])
		polyKeys = append(polyKeys, block0[:32]...)
		out := make([]byte, m)
		c.XORKeyStream(out, src[i*m:(i+1)*m])
		dst = append(dst, out...)
	}
	return subkeys, polyKeys, dst
}

// TestXAEADEngines runs XAEADKeys then XORKeyStreamSubkeys on every engine against
// x/crypto, for message counts around the 16-lane chunk, message lengths that are and
// are not whole kernel chunks, in place and not, and checks that the nonces are left
// alone.
func TestXAEADEngines(t *testing.T) {
	t.Parallel()
	for _, e := range engines() {
		t.Run(e.String(), func(t *testing.T) {
			t.Parallel()
			r := rand.New(rand.NewPCG(uint64(e), 99))
			for _, n := range []int{0, 1, 2, 15, 16, 17, 33} {
				for _, m := range []int{0, 1, 63, 64, 512, 1000, 4096} {
					if n == 0 && m > 0 {
						continue
					}
					for _, inPlace := range []bool{false, true} {
						var key [KeySize]byte
						fill(r, key[:])
						nonces := make([]byte, n*NonceSizeX)
						fill(r, nonces)
						src := make([]byte, n*m)
						fill(r, src)
						origNonces := bytes.Clone(nonces)
						wantSub, wantKeys, want := aeadRef(t, &key, nonces, src)
						dst := make([]byte, len(src))
						if inPlace {
							dst = bytes.Clone(src)
							src = dst
						}
						sub, keys := make([]byte, n*SubkeySize), make([]byte, n*PolyKeySize)
						xaeadKeys(e, &key, nonces, sub, keys)
						xorSubkeys(e, sub, nonces, dst, src)
						name := fmt.Sprintf("%v n=%d m=%d inPlace=%v", e, n, m, inPlace)
						if !bytes.Equal(sub, wantSub) {
							t.Fatalf("%s: subkeys differ from x/crypto's HChaCha20", name)
						}
						if !bytes.Equal(keys, wantKeys) {
							t.Fatalf("%s: Poly1305 keys differ from x/crypto", name)
						}
						if !bytes.Equal(dst, want) {
							t.Fatalf("%s: ciphertext differs from x/crypto", name)
						}
						if !bytes.Equal(nonces, origNonces) {
							t.Fatalf("%s: the nonces changed", name)
						}
					}
				}
			}
		})
	}
}

// TestXAEADPanics: the arguments XAEADKeys and XORKeyStreamSubkeys refuse.
func TestXAEADPanics(t *testing.T) {
	t.Parallel()
	var key [KeySize]byte
	nonces := make([]byte, 2*NonceSizeX)
	buf := make([]byte, 128)
	k64 := func() []byte { return make([]byte, 64) }
	for name, f := range map[string]func(){
		"short subkeys":      func() { XAEADKeys(&key, nonces, make([]byte, 32), k64()) },
		"short poly keys":    func() { XAEADKeys(&key, nonces, k64(), make([]byte, 32)) },
		"uneven nonces":      func() { XAEADKeys(&key, nonces[:47], k64(), k64()) },
		"subkeys = polykeys": func() { b := k64(); XAEADKeys(&key, nonces, b, b) },
		"keys overlap nonces": func() {
			both := make([]byte, 2*NonceSizeX+64)
			XAEADKeys(&key, both[:2*NonceSizeX], both[32:96], k64())
		},
		"short stream subkeys":   func() { XORKeyStreamSubkeys(make([]byte, 32), nonces, buf, buf) },
		"subkeys overlap dst":    func() { XORKeyStreamSubkeys(buf[:64], nonces, buf, buf) },
		"uneven stream messages": func() { XORKeyStreamSubkeys(k64(), nonces, buf[:127], buf[:127]) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}

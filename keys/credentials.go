package keys

import (
	"bytes"
	"crypto/sha512"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
)

// Credentials are what the user gives to unlock a keyslot: a passphrase, keyfile contents,
// or both. An empty passphrase counts as none. Wipe clears them once they are used.
type Credentials struct {
	Passphrase []byte
	Keyfiles   [][]byte // file contents; their order does not matter
}

// Uses says which credentials a keyslot takes: bit 0 passphrase, bit 1 keyfiles (the
// slot's credential flags on disk).
type Uses uint8

const (
	UsesPassphrase Uses = 1 << iota
	UsesKeyfiles
)

func (u Uses) String() string {
	var parts []string
	if u&UsesPassphrase != 0 {
		parts = append(parts, "passphrase")
	}
	if u&UsesKeyfiles != 0 {
		parts = append(parts, "keyfiles")
	}
	if u&^(UsesPassphrase|UsesKeyfiles) != 0 || len(parts) == 0 {
		return fmt.Sprintf("uses(%d)", uint8(u))
	}
	return strings.Join(parts, "+")
}

func (u Uses) valid() bool { return u >= 1 && u <= UsesPassphrase|UsesKeyfiles }

// Uses reports which credentials c holds.
func (c Credentials) Uses() Uses {
	var u Uses
	if len(c.Passphrase) > 0 {
		u |= UsesPassphrase
	}
	if len(c.Keyfiles) > 0 {
		u |= UsesKeyfiles
	}
	return u
}

// check refuses credentials that would make a weak or surprising key: none at all, or an
// empty keyfile (an empty file is almost surely a mistake, e.g. /dev/null).
func (c Credentials) check() error {
	if c.Uses() == 0 {
		return ErrNoCredentials
	}
	if uint64(len(c.Passphrase)) > math.MaxUint32 || uint64(len(c.Keyfiles)) > math.MaxUint32 {
		return fmt.Errorf("%w: passphrase or keyfile list too long", ErrNoCredentials)
	}
	for i, k := range c.Keyfiles {
		if len(k) == 0 {
			return fmt.Errorf("keyfile %d is empty: an empty keyfile adds no secret", i+1)
		}
	}
	return nil
}

// Wipe zeroes the passphrase and keyfile contents in place.
func (c Credentials) Wipe() {
	clear(c.Passphrase)
	for _, k := range c.Keyfiles {
		clear(k)
	}
}

func (Credentials) String() string             { return redacted }
func (Credentials) GoString() string           { return redacted }
func (Credentials) Format(f fmt.State, _ rune) { _, _ = f.Write([]byte(redacted)) }
func (Credentials) LogValue() slog.Value       { return slog.StringValue(redacted) }

// ikm is the Argon2id input of docs/format.md ("Keyslot"):
//
//	SHA-512("eli-kdf-v1" ‖ u32 len(passphrase) ‖ passphrase ‖ u32 K ‖ sorted(SHA-512(keyfile_i)))
func (c Credentials) ikm() *Secret {
	hashes := make([][sha512.Size]byte, len(c.Keyfiles))
	for i, k := range c.Keyfiles {
		hashes[i] = sha512.Sum512(k)
	}
	slices.SortFunc(hashes, func(a, b [sha512.Size]byte) int { return bytes.Compare(a[:], b[:]) })

	h := sha512.New()
	var n [4]byte
	h.Write([]byte("eli-kdf-v1"))
	binary.LittleEndian.PutUint32(n[:], uint32(len(c.Passphrase)))
	h.Write(n[:])
	h.Write(c.Passphrase)
	binary.LittleEndian.PutUint32(n[:], uint32(len(hashes)))
	h.Write(n[:])
	for i := range hashes {
		h.Write(hashes[i][:])
		clear(hashes[i][:])
	}
	out := NewSecret(sha512.Size)
	sum := h.Sum(out.Bytes()[:0])
	if &sum[0] != &out.Bytes()[0] {
		panic("keys: sha512 sum did not land in the secret buffer")
	}
	h.Reset()
	return out
}

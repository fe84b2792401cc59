package keys

import (
	"crypto/cipher"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/elidisk/eli/internal/wipe"
	"golang.org/x/crypto/chacha20poly1305"
)

// Byte offsets inside a keyslot (docs/format.md, "Keyslot").
const (
	slotSize      = 192
	slotState     = 0
	slotKDF       = 1
	slotUses      = 2
	slotThreads   = 3
	slotTime      = 4
	slotMemory    = 8
	slotSalt      = 16
	slotNonce     = 48
	slotWrapped   = 72
	slotReserved2 = slotWrapped + MasterKeySize + chacha20poly1305.Overhead // 152

	saltSize = 32

	stateEmpty  = 0
	stateActive = 1
	kdfArgon2id = 1
)

// SlotInfo is the public part of a keyslot: nothing in it is secret.
type SlotInfo struct {
	Active bool
	Uses   Uses
	KDF    KDFParams
	Salt   [32]byte // random per slot and per setkey
}

func slotBytes(raw *[HeaderSize]byte, i int) []byte {
	off := offSlots + i*slotSize
	return raw[off : off+slotSize : off+slotSize]
}

// decodeSlot checks and parses one keyslot; an active slot's KDF parameters are bounded
// here, before anything could run Argon2 with them.
func decodeSlot(s []byte) (SlotInfo, error) {
	le := binary.LittleEndian
	switch s[slotState] {
	case stateEmpty:
		if !allZero(s) {
			return SlotInfo{}, errors.New("marked empty but not zeroed")
		}
		return SlotInfo{}, nil
	case stateActive:
	default:
		return SlotInfo{}, fmt.Errorf("unknown state %d", s[slotState])
	}
	if s[slotKDF] != kdfArgon2id {
		return SlotInfo{}, fmt.Errorf("unknown KDF %d", s[slotKDF])
	}
	info := SlotInfo{Active: true, Uses: Uses(s[slotUses])}
	if !info.Uses.valid() {
		return SlotInfo{}, fmt.Errorf("unknown credential flags %#x", s[slotUses])
	}
	info.KDF = KDFParams{
		Time:      le.Uint32(s[slotTime:]),
		MemoryKiB: le.Uint32(s[slotMemory:]),
		Threads:   s[slotThreads],
	}
	if err := info.KDF.Validate(); err != nil {
		return SlotInfo{}, err
	}
	if !allZero(s[12:slotSalt]) || !allZero(s[slotReserved2:]) {
		return SlotInfo{}, errors.New("reserved bytes are not zero")
	}
	copy(info.Salt[:], s[slotSalt:])
	return info, nil
}

// slotAD is a keyslot's additional data: header bytes [0, 80) with the sequence zeroed,
// the slot index (u32), and the slot's bytes [0, 48) (state, KDF, flags, parameters, salt).
func slotAD(raw *[HeaderSize]byte, i int) []byte {
	ad := authenticatedPrefix(raw, slotADFields)
	ad = binary.LittleEndian.AppendUint32(ad, uint32(i))
	return append(ad, slotBytes(raw, i)[:slotNonce]...)
}

// sealSlot writes keyslot i of raw: fresh salt and nonce from rnd, the master key wrapped
// under Argon2id(c) with the header fields as AD. raw's fields [0, 80) must be final.
func sealSlot(raw *[HeaderSize]byte, i int, mk *MasterKey, c Credentials, p KDFParams, rnd io.Reader) error {
	if err := c.check(); err != nil {
		return err
	}
	if err := p.Validate(); err != nil {
		return err
	}
	s := slotBytes(raw, i)
	clear(s)
	s[slotState] = stateActive
	s[slotKDF] = kdfArgon2id
	s[slotUses] = byte(c.Uses())
	s[slotThreads] = p.Threads
	binary.LittleEndian.PutUint32(s[slotTime:], p.Time)
	binary.LittleEndian.PutUint32(s[slotMemory:], p.MemoryKiB)
	if _, err := io.ReadFull(rnd, s[slotSalt:slotNonce]); err != nil {
		clear(s)
		return fmt.Errorf("keyslot salt: %w", err)
	}
	if _, err := io.ReadFull(rnd, s[slotNonce:slotWrapped]); err != nil {
		clear(s)
		return fmt.Errorf("keyslot nonce: %w", err)
	}
	ikm := c.ikm()
	defer ikm.Wipe()
	err := withKEK(p, ikm, s[slotSalt:slotNonce], func(aead cipher.AEAD) error {
		// Seal appends within s's capacity: s[72:72] has room for 64 + 16 bytes before 152.
		aead.Seal(s[slotWrapped:slotWrapped], s[slotNonce:slotWrapped], mk.key.Bytes(), slotAD(raw, i))
		return nil
	})
	if err != nil {
		clear(s)
		return fmt.Errorf("keyslot cipher: %w", err)
	}
	return nil
}

// openSlot unwraps keyslot i with an ikm; it returns nil if the slot does not open.
func openSlot(raw *[HeaderSize]byte, i int, info SlotInfo, ikm *Secret) *Secret {
	s := slotBytes(raw, i)
	out := NewSecret(MasterKeySize)
	err := withKEK(info.KDF, ikm, info.Salt[:], func(aead cipher.AEAD) error {
		_, err := aead.Open(out.Bytes()[:0], s[slotNonce:slotWrapped], s[slotWrapped:slotReserved2], slotAD(raw, i))
		return err
	})
	if err != nil {
		out.Wipe()
		return nil
	}
	return out
}

// withKEK derives a keyslot's key-encryption key and runs fn with an XChaCha20-Poly1305
// AEAD under it. The KEK is wiped as soon as the AEAD holds its own copy, and that copy
// when fn returns, so no key outlives the call in either. (x/crypto's Seal and Open still
// derive a per-message subkey into memory of their own, which nothing here can reach.)
func withKEK(p KDFParams, ikm *Secret, salt []byte, fn func(cipher.AEAD) error) error {
	kek := p.kek(ikm, salt)
	aead, err := chacha20poly1305.NewX(kek.Bytes())
	kek.Wipe()
	if err != nil {
		return err
	}
	defer wipe.AEADKey(aead)
	return fn(aead)
}

package keys

import (
	"crypto/hmac"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"

	"github.com/elidisk/eli/sector"

	"github.com/elidisk/eli/internal/wipe"
)

// MasterKeySize is the length of the master key.
const MasterKeySize = 64

// HKDF info strings (docs/format.md, "Keys").
const (
	infoData      = "eli/v1/data"
	infoJournal   = "eli/v1/journal"
	infoHeaderMAC = "eli/v1/header-mac"
)

// MasterKey is a volume's master key together with the volume ID that salts every key
// derived from it. It lives in a Secret; Wipe it when done. Like Secret, it never prints.
type MasterKey struct {
	volumeID [16]byte
	key      *Secret
}

// NewMasterKey wraps a master key received from elsewhere (the attach server reads it
// from the pipe its parent wrote Bytes to). It copies key into locked memory; the caller
// wipes its own copy. Check it against the header with (*Header).Verify before use.
func NewMasterKey(volumeID [16]byte, key []byte) (*MasterKey, error) {
	if len(key) != MasterKeySize {
		return nil, fmt.Errorf("master key is %d bytes, expected %d", len(key), MasterKeySize)
	}
	return &MasterKey{volumeID: volumeID, key: secretFrom(key)}, nil
}

// GenerateMasterKey returns a random volume ID and master key that no header records:
// what `eli onetime` serves with.
func GenerateMasterKey() (*MasterKey, error) {
	return generateMasterKey(rand.Reader)
}

func generateMasterKey(rnd io.Reader) (*MasterKey, error) {
	mk := &MasterKey{key: NewSecret(MasterKeySize)}
	if _, err := io.ReadFull(rnd, mk.volumeID[:]); err != nil {
		mk.Wipe()
		return nil, fmt.Errorf("random volume ID: %w", err)
	}
	if _, err := io.ReadFull(rnd, mk.key.Bytes()); err != nil {
		mk.Wipe()
		return nil, fmt.Errorf("random master key: %w", err)
	}
	return mk, nil
}

// VolumeID is the ID of the volume the key belongs to.
func (k *MasterKey) VolumeID() [16]byte { return k.volumeID }

// Bytes is the raw master key, valid until Wipe: only for handing the key to the server
// process over a pipe. Never write it anywhere else.
func (k *MasterKey) Bytes() []byte { return k.key.Bytes() }

// DataKey derives the sector codec's key for mode (mode.KeySize() bytes; empty for
// "none"). The caller wipes it once the codec has its copy.
func (k *MasterKey) DataKey(mode sector.Mode) *Secret {
	return k.derive(infoData, mode.KeySize())
}

// JournalKey derives the 32-byte key that seals the journal. The caller wipes it.
func (k *MasterKey) JournalKey() *Secret { return k.derive(infoJournal, 32) }

func (k *MasterKey) headerMACKey() *Secret { return k.derive(infoHeaderMAC, 32) }

// derive is HKDF-SHA256(ikm = master key, salt = volume ID, info), n bytes, computed in
// memory that is cleared (hkdf.go).
func (k *MasterKey) derive(info string, n int) *Secret {
	s := NewSecret(n)
	if n > 0 {
		// SHA-256 keeps its blocks and states on the stack, the key's and the output's
		// among them (internal/wipe's Stack).
		wipe.Stack()
		hkdfSHA256(s.Bytes(), k.key.Bytes(), k.volumeID[:], info)
		wipe.Stack()
	}
	return s
}

// Wipe zeroes the master key. The MasterKey must not be used afterwards.
func (k *MasterKey) Wipe() {
	if k != nil {
		k.key.Wipe()
	}
}

func (MasterKey) String() string             { return redacted }
func (MasterKey) GoString() string           { return redacted }
func (MasterKey) Format(f fmt.State, _ rune) { _, _ = f.Write([]byte(redacted)) }
func (MasterKey) LogValue() slog.Value       { return slog.StringValue(redacted) }

// headerMAC is HMAC-SHA256 under the header-MAC key over header bytes [0, 96) with the
// sequence zeroed, and the key epoch once it is not 0 (macInput).
func headerMAC(raw *[HeaderSize]byte, mk *MasterKey) []byte {
	key := mk.headerMACKey()
	defer key.Wipe()
	h := newKeyedHash()
	defer h.wipe()
	mac := make([]byte, hmacSize)
	h.sum(mac, key.Bytes(), macInput(raw))
	return mac
}

func setMAC(raw *[HeaderSize]byte, mk *MasterKey) {
	copy(raw[offMAC:offMAC+macSize], headerMAC(raw, mk))
}

// Verify checks that mk is this volume's master key and that the header fields it
// authenticates (everything in bytes [0, 96) but the sequence) are the ones it was
// written with. Errors wrap ErrWrongKey or ErrHeaderTampered.
func (h *Header) Verify(mk *MasterKey) error {
	if mk == nil || mk.key.Len() != MasterKeySize {
		return newError(ErrWrongKey, "no master key (wiped?)")
	}
	if id := h.rawVolumeID(); mk.volumeID != id {
		return newError(ErrWrongKey, "the master key belongs to volume %x, not %x", mk.volumeID, id)
	}
	if !hmac.Equal(headerMAC(&h.raw, mk), h.raw[offMAC:offMAC+macSize]) {
		return newError(ErrHeaderTampered, "header fields were modified (the header MAC does not verify under the unlocked master key)")
	}
	return nil
}

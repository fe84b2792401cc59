// Package sector holds eli's per-sector transforms (codecs). A codec turns one plaintext
// sector into one ciphertext sector, and back, given the sector's index. It never does
// I/O: blockdev/ decides where sectors and their metadata live.
//
// Two kinds of codec exist:
//
//   - authenticated (MetaSize() > 0): xchacha20-poly1305, the default. Every Seal draws a
//     fresh random nonce; nonce and tag go into a metadata record kept beside the sector.
//     An all-zero record means "never written": blockdev/ reads such a sector as zeroes
//     without calling Open.
//   - length-preserving (MetaSize() == 0): aes-xts, the UNSAFE *-xts ChaCha modes kept for
//     benchmark parity, and none. Their ciphertext is a function of key, index and
//     plaintext only.
package sector

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
)

// Limits on the sector size, in bytes. Every power of two between them is valid.
const (
	MinSectorSize = 512
	MaxSectorSize = 65536
)

// ErrAuth is returned by Open when a sector or its metadata record fails authentication.
// It wraps EIO so that an NBD server reports it as an I/O error.
var ErrAuth = fmt.Errorf("sector failed authentication: %w", syscall.EIO)

// Mode names one codec. Its numeric value is stored in the volume header, so existing
// values never change meaning.
type Mode uint8

const (
	ModeInvalid           Mode = 0
	ModeXChaCha20Poly1305 Mode = 1
	ModeAESXTS256         Mode = 2 // AES-256 in XTS mode (512-bit XTS key)
	ModeAESXTS128         Mode = 3 // AES-128 in XTS mode (256-bit XTS key)
	ModeChaCha20XTS       Mode = 4
	ModeChaCha12XTS       Mode = 5
	ModeChaCha8XTS        Mode = 6
	ModeXChaCha20XTS      Mode = 7
	ModeXChaCha12XTS      Mode = 8
	ModeXChaCha8XTS       Mode = 9
	ModeNone              Mode = 10
)

// Default is the mode `eli init` uses unless told otherwise.
const Default = ModeXChaCha20Poly1305

type modeInfo struct {
	name     string
	keySize  int  // bytes of key material the codec takes
	metaSize int  // metadata bytes per sector
	unsafe   bool // keystream fixed per sector: benchmark parity only
}

// modes is indexed by Mode (an array, not a map: the geometry of every I/O asks for the
// mode's metadata size). A zero entry is no mode.
var modes = [...]modeInfo{
	ModeXChaCha20Poly1305: {"xchacha20-poly1305", 32, 40, false},
	ModeAESXTS256:         {"aes-xts", 64, 0, false},
	ModeAESXTS128:         {"aes128-xts", 32, 0, false},
	ModeChaCha20XTS:       {"chacha20-xts", 32, 0, true},
	ModeChaCha12XTS:       {"chacha12-xts", 32, 0, true},
	ModeChaCha8XTS:        {"chacha8-xts", 32, 0, true},
	ModeXChaCha20XTS:      {"xchacha20-xts", 32, 0, true},
	ModeXChaCha12XTS:      {"xchacha12-xts", 32, 0, true},
	ModeXChaCha8XTS:       {"xchacha8-xts", 32, 0, true},
	ModeNone:              {"none", 0, 0, false},
}

// Modes lists every valid mode, default first.
func Modes() []Mode {
	return []Mode{
		ModeXChaCha20Poly1305, ModeAESXTS256, ModeAESXTS128,
		ModeChaCha20XTS, ModeChaCha12XTS, ModeChaCha8XTS,
		ModeXChaCha20XTS, ModeXChaCha12XTS, ModeXChaCha8XTS,
		ModeNone,
	}
}

// ParseMode maps a mode's name (as printed by String) to the mode.
func ParseMode(name string) (Mode, error) {
	n := strings.ToLower(strings.TrimSpace(name))
	for m, info := range modes {
		if info.name != "" && info.name == n {
			return Mode(m), nil
		}
	}
	names := make([]string, 0, len(modes))
	for _, m := range Modes() {
		names = append(names, m.String())
	}
	return ModeInvalid, fmt.Errorf("unknown cipher mode %q (valid: %s)", name, strings.Join(names, ", "))
}

func (m Mode) String() string {
	if m.Valid() {
		return modes[m].name
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// Valid reports whether m is a known mode.
func (m Mode) Valid() bool { return int(m) < len(modes) && modes[m].name != "" }

// KeySize is the number of key bytes New expects for m.
func (m Mode) KeySize() int { return m.info().keySize }

// MetaSize is the number of metadata bytes per sector that m needs (0: length-preserving).
func (m Mode) MetaSize() int { return m.info().metaSize }

// Unsafe reports whether m is one of the ChaCha "XTS" modes whose keystream is fixed per
// sector: anyone who sees two versions of a sector learns their XOR. See docs/threat-model.md.
func (m Mode) Unsafe() bool { return m.info().unsafe }

// Authenticated reports whether m detects tampering.
func (m Mode) Authenticated() bool { return m.info().metaSize > 0 }

// info is m's entry, or the zero entry for an invalid mode.
func (m Mode) info() modeInfo {
	if int(m) < len(modes) {
		return modes[m]
	}
	return modeInfo{}
}

// Codec seals and opens sectors of one volume. Implementations are safe for concurrent use.
type Codec interface {
	Mode() Mode
	SectorSize() int
	// MetaSize is the length of the metadata record Seal fills and Open reads; 0 for
	// length-preserving codecs, which ignore meta.
	MetaSize() int
	// Seal encrypts buf (exactly SectorSize bytes of plaintext) in place as sector index,
	// writing the sector's metadata record into meta (MetaSize bytes).
	Seal(index uint64, buf, meta []byte)
	// Open decrypts buf in place. It returns an error wrapping ErrAuth when buf or meta was
	// not produced by Seal for this index and volume; buf's contents are then unspecified
	// and must not be returned to anyone.
	Open(index uint64, buf, meta []byte) error
	// Wipe zeroes the codec's key material. The codec must not be used afterwards.
	Wipe()
}

// Params are what New needs to build a codec.
type Params struct {
	Mode       Mode
	SectorSize int
	Key        []byte   // Mode.KeySize() bytes; New copies it
	VolumeID   [16]byte // bound into authenticated sectors so they cannot move between volumes
}

// ValidSectorSize reports whether n is a power of two in [MinSectorSize, MaxSectorSize].
func ValidSectorSize(n int) bool {
	return n >= MinSectorSize && n <= MaxSectorSize && n&(n-1) == 0
}

// New builds the codec for p.Mode.
func New(p Params) (Codec, error) {
	if !p.Mode.Valid() {
		return nil, fmt.Errorf("sector: invalid mode %d", uint8(p.Mode))
	}
	if !ValidSectorSize(p.SectorSize) {
		return nil, fmt.Errorf("sector: invalid sector size %d (need a power of two from %d to %d)",
			p.SectorSize, MinSectorSize, MaxSectorSize)
	}
	if len(p.Key) != p.Mode.KeySize() {
		return nil, fmt.Errorf("sector: %s needs a %d-byte key, got %d", p.Mode, p.Mode.KeySize(), len(p.Key))
	}
	switch p.Mode {
	case ModeXChaCha20Poly1305:
		return newAEAD(p)
	case ModeAESXTS256, ModeAESXTS128:
		return newAESXTS(p)
	case ModeChaCha20XTS, ModeChaCha12XTS, ModeChaCha8XTS,
		ModeXChaCha20XTS, ModeXChaCha12XTS, ModeXChaCha8XTS:
		return newChaChaXTS(p)
	case ModeNone:
		return newNone(p), nil
	}
	return nil, errors.New("sector: unreachable")
}

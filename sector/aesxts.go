package sector

import (
	"crypto/aes"
	"crypto/subtle"
	"fmt"

	"golang.org/x/crypto/xts"
)

// aesXTS is AES-XTS (IEEE 1619) from golang.org/x/crypto/xts, with the sector index as
// the tweak: the data unit number, little-endian in the first 8 bytes of the 16-byte
// tweak block, as geli and dm-crypt's plain64 number sectors. The key is two AES keys,
// data key then tweak key: 64 bytes for aes-xts (AES-256), 32 for aes128-xts.
//
// Confidentiality only, per sector: equal plaintexts at one index give equal
// ciphertexts, and a changed ciphertext decrypts to garbage rather than to an error.
type aesXTS struct {
	mode Mode
	size int
	c    *xts.Cipher // nil after Wipe
}

func newAESXTS(p Params) (Codec, error) {
	half := len(p.Key) / 2
	// FIPS 140-3 IG C.I (XTS-AES) requires distinct halves, as Linux's xts_verify_key
	// enforces in FIPS mode; with derived keys this only fails if derivation is broken.
	if subtle.ConstantTimeCompare(p.Key[:half], p.Key[half:]) == 1 {
		return nil, fmt.Errorf("sector: %s key is unusable: its data and tweak halves are equal", p.Mode)
	}
	// xts.NewCipher keeps only the AES key schedules, never p.Key itself.
	c, err := xts.NewCipher(aes.NewCipher, p.Key)
	if err != nil {
		return nil, fmt.Errorf("sector: %s: %w", p.Mode, err)
	}
	return &aesXTS{mode: p.Mode, size: p.SectorSize, c: c}, nil
}

func (c *aesXTS) Mode() Mode      { return c.mode }
func (c *aesXTS) SectorSize() int { return c.size }
func (c *aesXTS) MetaSize() int   { return 0 }

func (c *aesXTS) Seal(index uint64, buf, _ []byte) {
	mustFit(c.mode, c.size, buf)
	c.live().Encrypt(buf, buf, index)
}

// SealTo is Seal from src into dst (each one sector, not overlapping): the optional
// extension blockdev uses to encrypt a write without copying it first.
func (c *aesXTS) SealTo(index uint64, dst, src, _ []byte) {
	mustFit(c.mode, c.size, dst)
	mustFit(c.mode, c.size, src)
	c.live().Encrypt(dst, src, index)
}

func (c *aesXTS) Open(index uint64, buf, _ []byte) error {
	if err := checkSector(c.mode, c.size, buf); err != nil {
		return err
	}
	c.live().Decrypt(buf, buf, index)
	return nil
}

// Wipe drops the cipher. The AES round keys live inside crypto/aes, whose API cannot
// zero them; they become unreachable and are overwritten when the memory is reused.
func (c *aesXTS) Wipe() { c.c = nil }

func (c *aesXTS) live() *xts.Cipher {
	if c.c == nil {
		panic("sector: " + c.mode.String() + " codec used after Wipe")
	}
	return c.c
}

// checkSector reports a buffer that is not exactly one sector.
func checkSector(m Mode, size int, buf []byte) error {
	if len(buf) != size {
		return fmt.Errorf("sector: %s codec given %d bytes, its sector size is %d", m, len(buf), size)
	}
	return nil
}

// mustFit panics on a buffer that is not exactly one sector: Seal has no error to
// return, and encrypting part of a sector, or past it, would be a silent corruption.
func mustFit(m Mode, size int, buf []byte) {
	if err := checkSector(m, size, buf); err != nil {
		panic(err.Error())
	}
}

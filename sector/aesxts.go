package sector

import (
	"crypto/subtle"
	"fmt"

	"github.com/elidisk/eli/internal/aesxts"
)

// aesXTS is AES-XTS (IEEE 1619) from package aesxts, with the sector index as the
// tweak: the data unit number, little-endian in the first 8 bytes of the 16-byte tweak
// block, as geli and dm-crypt's plain64 number sectors. The key is two AES keys, data key
// then tweak key: 64 bytes for aes-xts (AES-256), 32 for aes128-xts. aesxts runs AES-NI
// or VAES assembly where the CPU has it and golang.org/x/crypto/xts elsewhere; every
// implementation gives x/crypto/xts's bytes.
//
// Confidentiality only, per sector: equal plaintexts at one index give equal
// ciphertexts, and a changed ciphertext decrypts to garbage rather than to an error.
type aesXTS struct {
	mode Mode
	size int
	c    *aesxts.Cipher // nil after Wipe
}

func newAESXTS(p Params) (Codec, error) {
	half := len(p.Key) / 2
	// FIPS 140-3 IG C.I (XTS-AES) requires distinct halves, as Linux's xts_verify_key
	// enforces in FIPS mode; with derived keys this only fails if derivation is broken.
	if subtle.ConstantTimeCompare(p.Key[:half], p.Key[half:]) == 1 {
		return nil, fmt.Errorf("sector: %s key is unusable: its data and tweak halves are equal", p.Mode)
	}
	// aesxts.New keeps only the AES round keys, never p.Key itself.
	c, err := aesxts.New(p.Key)
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

func (c *aesXTS) Open(index uint64, buf, _ []byte) error {
	if err := checkSector(c.mode, c.size, buf); err != nil {
		return err
	}
	c.live().Decrypt(buf, buf, index)
	return nil
}

// SealRun encrypts the run in one aesxts call, which computes each sector's tweak while
// the previous sector's blocks are in flight.
func (c *aesXTS) SealRun(first uint64, dst, src []byte) {
	mustRun(c.mode, c.size, dst, src)
	c.live().EncryptSectors(dst, src, c.size, first)
}

func (c *aesXTS) OpenRun(first uint64, dst, src []byte) error {
	if err := checkRun(c.mode, c.size, dst, src); err != nil {
		return err
	}
	c.live().DecryptSectors(dst, src, c.size, first)
	return nil
}

// Wipe zeroes the AES round keys (with the x/crypto/xts fallback they live inside
// crypto/aes, which cannot zero them: they become unreachable instead).
func (c *aesXTS) Wipe() {
	if c.c != nil {
		c.c.Wipe()
	}
	c.c = nil
}

func (c *aesXTS) live() *aesxts.Cipher {
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

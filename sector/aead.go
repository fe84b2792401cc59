package sector

import (
	"crypto/cipher"
	"encoding/binary"
	"fmt"
	"sync"

	"github.com/elidisk/eli/internal/chacha"
	"github.com/elidisk/eli/internal/poly1305"
	"github.com/elidisk/eli/internal/wipe"
	"golang.org/x/crypto/chacha20poly1305"
)

// Layout of the xchacha20-poly1305 record and additional data (docs/format.md, "Record"
// and "Sector seal").
const (
	aeadNonceSize = chacha20poly1305.NonceSizeX // 24
	aeadTagSize   = chacha20poly1305.Overhead   // 16
	aeadMetaSize  = aeadNonceSize + aeadTagSize // 40

	adLabel      = "eli-sector-v1"
	adPrefixSize = len(adLabel) + 16 + 1 + 4 // label, volume ID, mode, sector size
	adSize       = adPrefixSize + 8          // then the sector index
)

// aeadCodec is the default mode: XChaCha20-Poly1305 with a fresh random nonce per Seal.
//
// Nonces come from crypto/rand, one read per run of up to 16 sectors (aeadrun.go). One
// 24-byte read costs a small share of sealing a 4 KiB sector (BenchmarkNonce against
// BenchmarkAEADSeal4K; docs/benchmarks.md, "Measurements behind design choices"), and a
// read for 16 spreads that over the run. Nothing random is kept in memory between calls.
type aeadCodec struct {
	aead     cipher.AEAD // x/crypto's, for machines without a vector Poly1305
	key      *[32]byte   // the same key, for our own composition (aeadrun.go)
	fast     bool        // poly1305.Accelerated: seal and open with our composition
	loneMin  int         // loneFastSize (BenchmarkLoneSector sets 0 to measure the lanes below it)
	size     int
	adPrefix [adPrefixSize]byte
	scratch  sync.Pool // *aeadScratch
}

// polyKeySize is the length of a sector's one-time Poly1305 key.
const polyKeySize = chacha.PolyKeySize

// aeadScratch is per-call memory taken from a pool: the additional data, the nonces,
// subkeys and Poly1305 keys of one chunk of a run, and a sector-and-tag buffer for x/crypto's AEAD,
// which appends its tag. Keeping them here rather than on the stack keeps Seal and Open
// free of allocations (anything handed to an interface or assembly escapes).
type aeadScratch struct {
	ads      [aeadChunk * adSize]byte // a chunk's additional data, sector by sector
	tags     [aeadChunk * aeadTagSize]byte
	nonces   [aeadChunk * aeadNonceSize]byte
	subkeys  [aeadChunk * chacha.SubkeySize]byte
	polyKeys [aeadChunk * polyKeySize]byte
	ok       [aeadChunk]bool
	buf      []byte // size + tag, for x/crypto
}

func newAEAD(p Params) (Codec, error) {
	a, err := chacha20poly1305.NewX(p.Key)
	if err != nil {
		return nil, fmt.Errorf("sector: xchacha20-poly1305: %w", err)
	}
	c := &aeadCodec{aead: a, key: new([32]byte), fast: poly1305.Accelerated(), loneMin: loneFastSize, size: p.SectorSize}
	copy(c.key[:], p.Key)
	n := copy(c.adPrefix[:], adLabel)
	n += copy(c.adPrefix[n:], p.VolumeID[:])
	c.adPrefix[n] = byte(ModeXChaCha20Poly1305)
	binary.LittleEndian.PutUint32(c.adPrefix[n+1:], uint32(p.SectorSize))
	c.scratch.New = func() any {
		s := new(aeadScratch)
		for j := range aeadChunk {
			copy(s.ads[j*adSize:], c.adPrefix[:])
		}
		return s
	}
	return c, nil
}

func (c *aeadCodec) Mode() Mode      { return ModeXChaCha20Poly1305 }
func (c *aeadCodec) SectorSize() int { return c.size }
func (c *aeadCodec) MetaSize() int   { return aeadMetaSize }

// clearKeys wipes the key material a run left in the scratch.
func (s *aeadScratch) clearKeys() {
	clear(s.subkeys[:])
	clear(s.polyKeys[:])
}

// chunkADs sets the sector indexes in the additional data of the k sectors from first
// and returns it, adSize bytes per sector.
func (s *aeadScratch) chunkADs(first uint64, k int) []byte {
	for j := range k {
		binary.LittleEndian.PutUint64(s.ads[j*adSize+adPrefixSize:], first+uint64(j))
	}
	return s.ads[:k*adSize]
}

// fallback returns the scratch buffer x/crypto's AEAD seals into and opens from.
func (s *aeadScratch) fallback(size int) []byte {
	if cap(s.buf) < size+aeadTagSize {
		s.buf = make([]byte, size+aeadTagSize)
	}
	return s.buf[:size+aeadTagSize]
}

func (c *aeadCodec) checkLens(buf, meta []byte) {
	// A wrong length here is a bug in the caller, not bad input from a disk or client:
	// blockdev/ always passes whole sectors and whole records.
	if len(buf) != c.size || len(meta) != aeadMetaSize {
		panic(fmt.Sprintf("sector: xchacha20-poly1305 called with a %d-byte sector and a %d-byte record (want %d and %d)",
			len(buf), len(meta), c.size, aeadMetaSize))
	}
}

// Seal and Open are the run calls (aeadrun.go) for a run of one sector.

func (c *aeadCodec) Seal(index uint64, buf, meta []byte) {
	c.checkLens(buf, meta)
	c.SealRunMeta(index, buf, buf, meta)
}

func (c *aeadCodec) Open(index uint64, buf, meta []byte) error {
	c.checkLens(buf, meta)
	if err := c.OpenRunMeta(index, buf, buf, meta); err != nil {
		return fmt.Errorf("sector %d: %w", index, ErrAuth)
	}
	return nil
}

// Wipe zeroes the key inside the x/crypto AEAD (see package wipe for how).
func (c *aeadCodec) Wipe() {
	wipe.AEADKey(c.aead)
	clear(c.key[:])
	c.aead = nil
}

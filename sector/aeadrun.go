package sector

import (
	"crypto/rand"
	"crypto/subtle"
	"fmt"
	"strings"

	"github.com/elidisk/eli/internal/chacha"
	"github.com/elidisk/eli/internal/poly1305"
	"github.com/elidisk/eli/internal/wipe"
)

// MetaRunner is implemented by the authenticated codec: Seal and Open for a run of
// consecutive sectors whose records lie side by side in meta (MetaSize bytes each). The
// output is exactly what Seal and Open give sector by sector; the point is the cost.
// blockdev/ hands it the runs of sectors of each request and refuses an authenticated
// codec without it.
//
// With a vector Poly1305 on the machine (poly1305.Accelerated), xchacha20-poly1305 runs
// as our own composition: chacha.XAEADKeys computes 16 sectors' subkeys and Poly1305
// keys in vector lanes, chacha.XORKeyStreamSubkeys the keystream with the AVX-512
// kernel, and poly1305.SumAEADMany the sixteen tags side by side, each kept apart from
// its ciphertext, which x/crypto's AEAD cannot do (it appends the tag, so every sector
// would need room behind it or a copy). The bytes are those of x/crypto's NewX, which the tests check
// (aeadrun_test.go); without the vector Poly1305 the codec calls x/crypto itself.
type MetaRunner interface {
	// SealRunMeta seals the len(src)/SectorSize() sectors of src, the first with index
	// first and the others with the following ones, into dst, and writes their records
	// into meta. dst and src are the same slice or do not overlap; it panics on wrong
	// lengths or an overlap before writing anything.
	SealRunMeta(first uint64, dst, src, meta []byte)
	// OpenRunMeta opens likewise. Each sector's tag is checked before it is decrypted;
	// a sector that fails is zeroed in dst, never decrypted, and the error (a
	// *RunAuthError) names every such sector. On the arguments SealRunMeta panics on, it
	// returns an error and writes nothing.
	OpenRunMeta(first uint64, dst, src, meta []byte) error
}

var _ MetaRunner = (*aeadCodec)(nil)

// RunAuthError lists the sectors of a run that failed authentication, in order. It
// wraps ErrAuth (and so syscall.EIO).
type RunAuthError struct{ Sectors []uint64 }

func (e *RunAuthError) Error() string {
	var b strings.Builder
	for i, s := range e.Sectors {
		if i == 8 {
			fmt.Fprintf(&b, " and %d more", len(e.Sectors)-i)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprint(&b, s)
	}
	return fmt.Sprintf("sectors %s: %v", b.String(), ErrAuth)
}

func (e *RunAuthError) Unwrap() error { return ErrAuth }

// aeadChunk is how many sectors one XAEADKeys call takes: one pass of 16 lanes.
const aeadChunk = 16

// loneFastSize is the least sector size at which a chunk of one sector (a lone random
// write or read, a read-modify-write edge) goes through the lanes too. Below it, x/crypto
// is quicker: its fused kernel gets block 0 almost free, where the lanes derive one
// sector's keys on their own (chacha.XAEADKeys' scalar path for a lone nonce), and a
// small sector has few blocks to win that back. BenchmarkLoneSector measures both ways
// at each size (docs/benchmarks.md, "Measurements behind design choices").
const loneFastSize = 1024

// viaXCrypto reports whether a chunk of k sectors goes to x/crypto sector by sector
// rather than through the lanes.
func (c *aeadCodec) viaXCrypto(k int) bool { return !c.fast || (k == 1 && c.size < c.loneMin) }

func (c *aeadCodec) checkMeta(dst, src, meta []byte) (int, error) {
	if err := checkRun(ModeXChaCha20Poly1305, c.size, dst, src); err != nil {
		return 0, err
	}
	n := len(src) / c.size
	if len(meta) != n*aeadMetaSize {
		return 0, fmt.Errorf("sector: xchacha20-poly1305 run of %d sectors given %d bytes of records, want %d", n, len(meta), n*aeadMetaSize)
	}
	if overlaps(meta, dst) || overlaps(meta, src) {
		return 0, fmt.Errorf("sector: xchacha20-poly1305 run's records overlap its sectors")
	}
	return n, nil
}

func (c *aeadCodec) SealRunMeta(first uint64, dst, src, meta []byte) {
	n, err := c.checkMeta(dst, src, meta)
	if err != nil {
		panic(err.Error())
	}
	s := c.scratch.Get().(*aeadScratch)
	defer c.scratch.Put(s)
	size := c.size
	for i := 0; i < n; i += aeadChunk {
		k := min(aeadChunk, n-i)
		nonces := s.nonces[:k*aeadNonceSize]
		rand.Read(nonces) // never fails (crypto/rand crashes the program rather than return short)
		for j := range k {
			copy(meta[(i+j)*aeadMetaSize:], nonces[j*aeadNonceSize:(j+1)*aeadNonceSize])
		}
		d, p := dst[i*size:(i+k)*size], src[i*size:(i+k)*size]
		if c.viaXCrypto(k) {
			for j := range k {
				c.sealXCrypto(s, first+uint64(i+j), d[j*size:(j+1)*size], p[j*size:(j+1)*size], meta[(i+j)*aeadMetaSize:(i+j+1)*aeadMetaSize])
			}
			continue
		}
		subkeys, keys := s.subkeys[:k*chacha.SubkeySize], s.polyKeys[:k*polyKeySize]
		chacha.XAEADKeys(c.key, nonces, subkeys, keys)
		chacha.XORKeyStreamSubkeys(subkeys, nonces, d, p)
		tags := s.tags[:k*aeadTagSize]
		poly1305.SumAEADMany(tags, keys, s.chunkADs(first+uint64(i), k), adSize, d, size)
		for j := range k {
			copy(meta[(i+j)*aeadMetaSize+aeadNonceSize:(i+j+1)*aeadMetaSize], tags[j*aeadTagSize:])
		}
	}
	s.clearKeys()
}

func (c *aeadCodec) OpenRunMeta(first uint64, dst, src, meta []byte) error {
	n, err := c.checkMeta(dst, src, meta)
	if err != nil {
		return err
	}
	s := c.scratch.Get().(*aeadScratch)
	defer c.scratch.Put(s)
	size := c.size
	var bad []uint64
	for i := 0; i < n; i += aeadChunk {
		k := min(aeadChunk, n-i)
		d, p := dst[i*size:(i+k)*size], src[i*size:(i+k)*size]
		if c.viaXCrypto(k) {
			for j := range k {
				if !c.openXCrypto(s, first+uint64(i+j), d[j*size:(j+1)*size], p[j*size:(j+1)*size], meta[(i+j)*aeadMetaSize:(i+j+1)*aeadMetaSize]) {
					clear(d[j*size : (j+1)*size])
					bad = append(bad, first+uint64(i+j))
				}
			}
			continue
		}
		nonces := s.nonces[:k*aeadNonceSize]
		for j := range k {
			copy(nonces[j*aeadNonceSize:], meta[(i+j)*aeadMetaSize:(i+j)*aeadMetaSize+aeadNonceSize])
		}
		// The tags first, over the ciphertext: only then is anything decrypted, and in
		// place the ciphertext is gone afterwards.
		subkeys, keys := s.subkeys[:k*chacha.SubkeySize], s.polyKeys[:k*polyKeySize]
		chacha.XAEADKeys(c.key, nonces, subkeys, keys)
		tags := s.tags[:k*aeadTagSize]
		poly1305.SumAEADMany(tags, keys, s.chunkADs(first+uint64(i), k), adSize, p, size)
		failed := 0
		for j := range k {
			ok := subtle.ConstantTimeCompare(tags[j*aeadTagSize:(j+1)*aeadTagSize], meta[(i+j)*aeadMetaSize+aeadNonceSize:(i+j+1)*aeadMetaSize]) == 1
			s.ok[j] = ok
			if !ok {
				failed++
			}
		}
		if failed == 0 {
			chacha.XORKeyStreamSubkeys(subkeys, nonces, d, p)
			continue
		}
		for j := range k {
			sd := d[j*size : (j+1)*size]
			if !s.ok[j] {
				clear(sd)
				bad = append(bad, first+uint64(i+j))
				continue
			}
			chacha.XORKeyStreamSubkeys(subkeys[j*chacha.SubkeySize:(j+1)*chacha.SubkeySize], nonces[j*aeadNonceSize:(j+1)*aeadNonceSize], sd, p[j*size:(j+1)*size])
		}
	}
	s.clearKeys()
	if bad != nil {
		return &RunAuthError{Sectors: bad}
	}
	return nil
}

// sealXCrypto seals one sector with x/crypto's AEAD, whose nonce is already in meta.
func (c *aeadCodec) sealXCrypto(s *aeadScratch, index uint64, dst, src, meta []byte) {
	tmp := s.fallback(c.size)
	wipe.Stack() // x/crypto keeps the key's words on the stack (internal/wipe's Stack)
	out := c.aead.Seal(tmp[:0], meta[:aeadNonceSize], src, s.chunkADs(index, 1))
	wipe.Stack()
	copy(dst, out[:c.size])
	copy(meta[aeadNonceSize:], out[c.size:])
}

// openXCrypto opens one sector with x/crypto's AEAD, which wants the tag behind the
// ciphertext: both go to scratch, and the plaintext straight into dst. It reports
// whether the sector was authentic; x/crypto zeroes its output when it was not.
func (c *aeadCodec) openXCrypto(s *aeadScratch, index uint64, dst, src, meta []byte) bool {
	tmp := s.fallback(c.size)
	copy(tmp, src)
	copy(tmp[c.size:], meta[aeadNonceSize:])
	wipe.Stack()
	_, err := c.aead.Open(dst[:0], meta[:aeadNonceSize], tmp, s.chunkADs(index, 1))
	wipe.Stack()
	return err == nil
}

// overlaps reports whether x and y share any byte.
func overlaps(x, y []byte) bool {
	return len(x) > 0 && len(y) > 0 && (inexactOverlap(x, y) || &x[0] == &y[0])
}

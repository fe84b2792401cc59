package sector

import (
	"encoding/binary"

	"github.com/elidisk/eli/internal/chacha"
)

// chachaXTS implements the UNSAFE modes chacha20-xts, chacha12-xts, chacha8-xts,
// xchacha20-xts, xchacha12-xts and xchacha8-xts. They exist only so that eli can be
// measured against the FreeBSD GEOM ELI ChaCha patch (freebsd-geom list, January 2015,
// "ChaCha8/12/20 and GEOM ELI tests"), which ran these ciphers under geli's XTS plumbing
// and was benchmarked against AES-XTS. That patch's source was not found, so the
// derivation below is eli's own, the simplest one that gives every sector its own
// keystream (docs/format.md, "Length-preserving transforms"):
//
//	chachaN-xts:  ChaCha-N, RFC 8439 layout, key = data key,
//	              nonce = LE64(sector index) ‖ 00 00 00 00, block counter 0
//	xchachaN-xts: XChaCha-N (HChaCha-N subkey), key = data key,
//	              nonce = LE64(sector index) ‖ 16 zero bytes, block counter 0
//
// and the sector is XORed with the keystream.
//
// Why this is unsafe: the keystream depends only on the key and the sector index, so
// every version of a sector is encrypted with the same keystream KS. Anyone who sees
// two versions of one sector (two snapshots, a backup and the disk, a disk image before
// and after) learns P1 ⊕ P2 = C1 ⊕ C2; anyone who also knows or guesses one plaintext,
// or can get chosen data written and read the ciphertext, recovers KS = C ⊕ P and with
// it every past and future version of that sector. There is no integrity either:
// flipping a ciphertext bit flips the same plaintext bit. "XTS" does not help: a tweak
// T whitening a stream cipher's input and output cancels out, (P ⊕ T) ⊕ KS ⊕ T = P ⊕ KS,
// leaving the fixed per-sector keystream. AES-XTS is not broken by the same two
// versions because a block cipher is a keyed permutation, not a XOR: they show which
// 16-byte blocks changed, not what they contain. Use xchacha20-poly1305 (the default),
// which draws a fresh nonce for every write, or aes-xts.
type chachaXTS struct {
	mode   Mode
	size   int
	rounds int
	x      bool // XChaCha
	wiped  bool
	key    [chacha.KeySize]byte
}

func newChaChaXTS(p Params) (Codec, error) {
	c := &chachaXTS{mode: p.Mode, size: p.SectorSize}
	switch p.Mode {
	case ModeChaCha20XTS, ModeXChaCha20XTS:
		c.rounds = 20
	case ModeChaCha12XTS, ModeXChaCha12XTS:
		c.rounds = 12
	case ModeChaCha8XTS, ModeXChaCha8XTS:
		c.rounds = 8
	}
	c.x = p.Mode == ModeXChaCha20XTS || p.Mode == ModeXChaCha12XTS || p.Mode == ModeXChaCha8XTS
	copy(c.key[:], p.Key) // New has checked the length
	return c, nil
}

func (c *chachaXTS) Mode() Mode      { return c.mode }
func (c *chachaXTS) SectorSize() int { return c.size }
func (c *chachaXTS) MetaSize() int   { return 0 }

func (c *chachaXTS) Seal(index uint64, buf, _ []byte) {
	mustFit(c.mode, c.size, buf)
	c.xor(index, buf, buf)
}

func (c *chachaXTS) Open(index uint64, buf, _ []byte) error {
	if err := checkSector(c.mode, c.size, buf); err != nil {
		return err
	}
	c.xor(index, buf, buf)
	return nil
}

// SealRun is Seal for a run of consecutive sectors (Runner). For xchacha*-xts it derives
// the sectors' HChaCha subkeys many at a time, which is what brings XChaCha to about the
// cost of ChaCha on runs of sectors.
func (c *chachaXTS) SealRun(first uint64, dst, src []byte) {
	mustRun(c.mode, c.size, dst, src)
	c.xorRun(first, dst, src)
}

// OpenRun is Open for a run of consecutive sectors (Runner).
func (c *chachaXTS) OpenRun(first uint64, dst, src []byte) error {
	if err := checkRun(c.mode, c.size, dst, src); err != nil {
		return err
	}
	c.xorRun(first, dst, src)
	return nil
}

// runChunk is the number of sectors whose nonces are built on the stack for one
// chacha.XORKeyStream(X)Many call: one AVX-512 batch of HChaCha subkeys.
const runChunk = 16

// xorRun XORs each sector of src with its keystream into dst: the nonces xor builds,
// sector after sector, with XChaCha's subkeys derived many at a time.
func (c *chachaXTS) xorRun(first uint64, dst, src []byte) {
	c.checkLive()
	n := len(src) / c.size
	ns := chacha.NonceSize
	if c.x {
		ns = chacha.NonceSizeX
	}
	// LE64(index) and zeroes to the nonce's end, which are never written.
	var nonces [runChunk * chacha.NonceSizeX]byte
	for k := 0; k < n; k += runChunk {
		m := min(runChunk, n-k)
		for j := range m {
			binary.LittleEndian.PutUint64(nonces[j*ns:], first+uint64(k+j))
		}
		lo, hi := k*c.size, (k+m)*c.size
		// Called directly, not through a func value, so that nonces stays on the stack.
		if c.x {
			chacha.XORKeyStreamXMany(c.rounds, &c.key, nonces[:m*ns], dst[lo:hi], src[lo:hi])
		} else {
			chacha.XORKeyStreamMany(c.rounds, &c.key, nonces[:m*ns], dst[lo:hi], src[lo:hi])
		}
	}
}

func (c *chachaXTS) checkLive() {
	if c.wiped {
		panic("sector: " + c.mode.String() + " codec used after Wipe")
	}
}

// xor XORs src with the sector's keystream into dst; sealing and opening are the same.
func (c *chachaXTS) xor(index uint64, dst, src []byte) {
	c.checkLive()
	if c.x {
		var nonce [chacha.NonceSizeX]byte
		binary.LittleEndian.PutUint64(nonce[:8], index)
		chacha.XORKeyStreamXAt(c.rounds, &c.key, &nonce, 0, dst, src)
		return
	}
	var nonce [chacha.NonceSize]byte
	binary.LittleEndian.PutUint64(nonce[:8], index)
	chacha.XORKeyStreamAt(c.rounds, &c.key, &nonce, 0, dst, src)
}

func (c *chachaXTS) Wipe() {
	clear(c.key[:])
	c.wiped = true
}

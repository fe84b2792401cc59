// Package tree is the hash tree that format v2 keeps over an authenticated volume's
// metadata blocks, so that a record put back from an older image, or zeroed in place, no
// longer opens as current (freshness; docs/design.md).
//
// Leaves are blocks whose bytes the caller holds (metadata blocks); interior nodes are
// NodeSize-byte blocks of Arity child digests, stored wherever the caller's Store says.
// The digest of a block is SHA-256 over its position and the SHA-256 of each of its
// PieceSize-byte pieces, so that changing a few bytes of a cached block rehashes one or
// two pieces and 8·32 bytes, not the whole block. A block of all zeroes has the all-zero
// digest: a volume whose metadata and tree regions were never written is a valid tree with
// the all-zero root, which keeps init instant, while a non-empty node zeroed on disk no
// longer matches the digest its parent holds.
package tree

import (
	"crypto/sha256"
	"encoding/binary"
)

const (
	DigestSize = sha256.Size
	NodeSize   = 4096
	Arity      = NodeSize / DigestSize // children per interior node
	PieceSize  = 512
)

// Digest is the digest of one block (leaf or node).
type Digest [DigestSize]byte

// IsZero reports whether d is the all-zero digest of an all-zero block.
func (d Digest) IsZero() bool { return d == Digest{} }

var zeroPiece = sha256.Sum256(make([]byte, PieceSize))

// domain opens every block digest's input, so that no other SHA-256 input of eli's can
// collide with one.
const domain = "eli-tree-v2"

// Hasher holds the piece digests of one block, so that a change of a few bytes costs a
// piece or two. The zero value is ready for Reset.
type Hasher struct {
	pieces []Digest
	zeros  int // pieces that are all zero
}

// Reset hashes every piece of block. len(block) must be a positive multiple of PieceSize.
func (h *Hasher) Reset(block []byte) {
	n := len(block) / PieceSize
	if len(block)%PieceSize != 0 || n == 0 {
		panic("tree: block length is not a positive multiple of PieceSize")
	}
	if cap(h.pieces) < n {
		h.pieces = make([]Digest, n)
	}
	h.pieces = h.pieces[:n]
	h.zeros = 0
	for i := range h.pieces {
		h.setPiece(i, block)
	}
}

func (h *Hasher) setPiece(i int, block []byte) {
	d := Digest(sha256.Sum256(block[i*PieceSize : (i+1)*PieceSize]))
	h.pieces[i] = d
	if d == zeroPiece {
		h.zeros++
	}
}

// Update rehashes the pieces of block that overlap [off, off+n), after the caller changed
// those bytes. Reset must have seen a block of the same length.
func (h *Hasher) Update(block []byte, off, n int) {
	if len(block) != len(h.pieces)*PieceSize || off < 0 || n < 0 || off+n > len(block) {
		panic("tree: Update outside the block Reset saw")
	}
	if n == 0 {
		return
	}
	for i := off / PieceSize; i <= (off+n-1)/PieceSize; i++ {
		if h.pieces[i] == zeroPiece {
			h.zeros--
		}
		h.setPiece(i, block)
	}
}

// Digest is the block's digest at (level, index): level 0 for leaves, 1 and up for
// interior nodes. An all-zero block has the all-zero digest.
func (h *Hasher) Digest(level int, index uint64) Digest {
	if h.zeros == len(h.pieces) {
		return Digest{}
	}
	s := sha256.New()
	var hdr [len(domain) + 1 + 8]byte
	copy(hdr[:], domain)
	hdr[len(domain)] = byte(level)
	binary.LittleEndian.PutUint64(hdr[len(domain)+1:], index)
	s.Write(hdr[:])
	for i := range h.pieces {
		s.Write(h.pieces[i][:])
	}
	var d Digest
	s.Sum(d[:0])
	return d
}

// BlockDigest is the digest of block at (level, index), computed from scratch.
func BlockDigest(level int, index uint64, block []byte) Digest {
	var h Hasher
	h.Reset(block)
	return h.Digest(level, index)
}

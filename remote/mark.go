package remote

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"time"
)

// The ownership mark is one 4096-byte block at provider offset 4096, inside the region
// after header copy A that format version 1 keeps zero and that v1 readers ignore
// (docs/format.md, "Ownership block"). Its layout, little-endian:
//
//	0    8  magic "ELIOWNR1"
//	8    4  state: 1 held, 2 released
//	12   4  heartbeat interval in milliseconds (1 to MaxInterval)
//	16  16  instance ID, random per attach
//	32   8  heartbeat counter
//	40   8  time of the last write, Unix nanoseconds (for messages only)
//	48   1  host name length (at most 255)
//	49 255  host name, zero-padded
//	304 32  SHA-256 of bytes 0..304
//
// The rest of the block is zero.
const (
	MarkOffset = 4096
	MarkLen    = 4096

	// MaxInterval bounds the interval read from a mark before a wait is based on it.
	MaxInterval = time.Minute

	markMagic    = "ELIOWNR1"
	markSumStart = 304
	markUsed     = markSumStart + sha256.Size
)

// State is what a mark says of the volume.
type State uint32

const (
	Empty    State = 0 // no mark: never claimed (all zero)
	Held     State = 1
	Released State = 2
)

// Mark is the decoded ownership block.
type Mark struct {
	State    State
	Interval time.Duration
	Instance [16]byte
	Counter  uint64
	Time     time.Time
	Host     string
}

// InstanceString is the instance ID as the messages show it.
func (m Mark) InstanceString() string { return hex.EncodeToString(m.Instance[:]) }

// errBadMark: the block is neither zero nor a valid mark (a torn write, or something
// that is not eli's). Claim treats it like a mark that stopped moving.
var errBadMark = errors.New("ownership block is not a valid mark")

func (m Mark) encode() []byte {
	b := make([]byte, MarkLen)
	copy(b, markMagic)
	binary.LittleEndian.PutUint32(b[8:], uint32(m.State))
	binary.LittleEndian.PutUint32(b[12:], uint32(m.Interval/time.Millisecond))
	copy(b[16:32], m.Instance[:])
	binary.LittleEndian.PutUint64(b[32:], m.Counter)
	binary.LittleEndian.PutUint64(b[40:], uint64(m.Time.UnixNano()))
	host := m.Host
	if len(host) > 255 {
		host = host[:255]
	}
	b[48] = byte(len(host))
	copy(b[49:], host)
	sum := sha256.Sum256(b[:markSumStart])
	copy(b[markSumStart:], sum[:])
	return b
}

// decodeMark reads a block: all zero, or anything without the magic, is Empty; a block
// with the magic that is not a well-formed mark (a torn write) is errBadMark. Every field is bounded before it is used.
func decodeMark(b []byte) (Mark, error) {
	if len(b) != MarkLen {
		return Mark{}, fmt.Errorf("ownership block of %d bytes", len(b))
	}
	if allZero(b) {
		return Mark{State: Empty}, nil
	}
	if string(b[:8]) != markMagic {
		// Not a mark at all: what a provider held before eli (init does not clear the
		// block before it claims it). Nothing eli wrote, so nobody holds the volume.
		return Mark{State: Empty}, nil
	}
	sum := sha256.Sum256(b[:markSumStart])
	if !bytes.Equal(sum[:], b[markSumStart:markUsed]) || !allZero(b[markUsed:]) {
		return Mark{}, fmt.Errorf("%w: checksum mismatch", errBadMark)
	}
	m := Mark{
		State:    State(binary.LittleEndian.Uint32(b[8:])),
		Interval: time.Duration(binary.LittleEndian.Uint32(b[12:])) * time.Millisecond,
		Counter:  binary.LittleEndian.Uint64(b[32:]),
		Time:     time.Unix(0, int64(binary.LittleEndian.Uint64(b[40:]))),
	}
	copy(m.Instance[:], b[16:32])
	n := int(b[48])
	m.Host = string(b[49 : 49+n])
	if !allZero(b[49+n : markSumStart]) {
		return Mark{}, fmt.Errorf("%w: bytes after the host name", errBadMark)
	}
	if m.State != Held && m.State != Released {
		return Mark{}, fmt.Errorf("%w: state %d", errBadMark, m.State)
	}
	if m.Interval <= 0 || m.Interval > MaxInterval {
		return Mark{}, fmt.Errorf("%w: interval %v", errBadMark, m.Interval)
	}
	return m, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

package blockdev

import (
	"bytes"
	"crypto/cipher"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/elidisk/eli/layout"

	"golang.org/x/crypto/chacha20poly1305"
)

// The journal's byte layout (docs/format.md, "Journal layout").
const (
	journalMagic     = "ELIJRNL1"
	journalHeaderLen = 64
	journalADLen     = 24 // header bytes [0, 24) are the additional data
	journalNonceOff  = 24
	journalTagLen    = chacha20poly1305.Overhead
	journalEntryLen  = 8 + 2*layout.RecordSize
	// JournalKeySize is the length of Config.JournalKey.
	JournalKeySize = chacha20poly1305.KeySize
)

// record is one sector's metadata record: nonce ‖ tag, or all zero for "reads as zeroes".
type record [layout.RecordSize]byte

func (r *record) isZero() bool { return *r == record{} }

// journalEntry says that sector index goes from record old to record new in one commit.
type journalEntry struct {
	index    uint64
	old, new record
}

// journal seals and opens the journal region. It is used by one goroutine at a time (the
// committer, or Open's recovery), so its buffer needs no lock.
type journal struct {
	aead   cipher.AEAD
	rand   io.Reader
	off    int64 // JournalOffset
	length int64 // J
	seq    uint64
	buf    []byte
}

func newJournal(key []byte, l Layout, rand io.Reader) (*journal, error) {
	a, err := chacha20poly1305.NewX(key)
	if err != nil {
		return nil, fmt.Errorf("journal key: %w", err)
	}
	return &journal{aead: a, rand: rand, off: l.JournalOffset(), length: l.JournalLen}, nil
}

// encode builds the sealed journal for entries under the next sequence number and returns
// the bytes to write at the journal's offset.
func (j *journal) encode(entries []journalEntry) ([]byte, error) {
	n := journalHeaderLen + len(entries)*journalEntryLen + journalTagLen
	if int64(n) > j.length {
		return nil, fmt.Errorf("journal: %d entries do not fit %d bytes", len(entries), j.length)
	}
	if cap(j.buf) < n {
		j.buf = make([]byte, n)
	}
	b := j.buf[:n]
	clear(b[:journalHeaderLen])
	j.seq++
	copy(b, journalMagic)
	binary.LittleEndian.PutUint64(b[8:], j.seq)
	binary.LittleEndian.PutUint32(b[16:], uint32(len(entries)))
	nonce := b[journalNonceOff : journalNonceOff+chacha20poly1305.NonceSizeX]
	if _, err := io.ReadFull(j.rand, nonce); err != nil {
		return nil, fmt.Errorf("journal nonce: %w", err)
	}
	p := b[journalHeaderLen:journalHeaderLen]
	for _, e := range entries {
		p = binary.LittleEndian.AppendUint64(p, e.index)
		p = append(p, e.old[:]...)
		p = append(p, e.new[:]...)
	}
	j.aead.Seal(p[:0], nonce, p, b[:journalADLen])
	return b, nil
}

// errNoJournal means the journal region holds nothing to replay: all zero (never written)
// or a header that is not a journal's.
var errNoJournal = errors.New("no journal")

// errJournalTorn means the journal has a header but does not open: a crash tore it before
// its sync completed, so none of its commit reached the data area.
var errJournalTorn = errors.New("journal does not open")

// read loads and opens the journal. It returns errNoJournal or errJournalTorn (wrapped)
// when there is nothing to replay, and other errors for I/O failures.
func (j *journal) read(r io.ReaderAt, sectors uint64) ([]journalEntry, error) {
	var h [journalHeaderLen]byte
	if _, err := r.ReadAt(h[:], j.off); err != nil {
		return nil, fmt.Errorf("read journal header: %w", err)
	}
	if string(h[:8]) != journalMagic {
		if h == [journalHeaderLen]byte{} {
			return nil, fmt.Errorf("%w: journal region is zero", errNoJournal)
		}
		return nil, fmt.Errorf("%w: journal region has no journal magic", errNoJournal)
	}
	seq := binary.LittleEndian.Uint64(h[8:])
	count := binary.LittleEndian.Uint32(h[16:])
	// The count is not authenticated yet: bound it by the region before reading that much.
	if int64(count) > (j.length-journalHeaderLen-journalTagLen)/journalEntryLen {
		return nil, fmt.Errorf("%w: entry count %d exceeds the %d-byte journal", errJournalTorn, count, j.length)
	}
	n := int(count)*journalEntryLen + journalTagLen
	if cap(j.buf) < journalHeaderLen+n {
		j.buf = make([]byte, journalHeaderLen+n)
	}
	b := j.buf[:journalHeaderLen+n]
	copy(b, h[:])
	if _, err := r.ReadAt(b[journalHeaderLen:], j.off+journalHeaderLen); err != nil {
		return nil, fmt.Errorf("read journal entries: %w", err)
	}
	nonce := b[journalNonceOff : journalNonceOff+chacha20poly1305.NonceSizeX]
	plain, err := j.aead.Open(b[journalHeaderLen:journalHeaderLen], nonce, b[journalHeaderLen:], b[:journalADLen])
	if err != nil {
		return nil, fmt.Errorf("%w (sequence %d, %d entries)", errJournalTorn, seq, count)
	}
	if !bytes.Equal(b[20:24], []byte{0, 0, 0, 0}) {
		return nil, fmt.Errorf("journal %d: reserved bytes are not zero", seq)
	}
	j.seq = seq
	entries := make([]journalEntry, count)
	seen := make(map[uint64]struct{}, count)
	for i := range entries {
		e := &entries[i]
		p := plain[i*journalEntryLen:]
		e.index = binary.LittleEndian.Uint64(p)
		copy(e.old[:], p[8:])
		copy(e.new[:], p[8+layout.RecordSize:])
		// The journal opened, so this is our own writing: a bad index is a bug or a
		// journal from another layout, and replaying it would scribble on the volume.
		if e.index >= sectors {
			return nil, fmt.Errorf("journal %d: entry %d names sector %d of %d", seq, i, e.index, sectors)
		}
		if _, dup := seen[e.index]; dup {
			return nil, fmt.Errorf("journal %d: sector %d appears twice", seq, e.index)
		}
		seen[e.index] = struct{}{}
	}
	return entries, nil
}

package blockdev

import (
	"bytes"
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
	// Format version 2: two slots of J/2 bytes, each with a header that also carries the
	// generation and the tree's root (docs/format.md, "Format version 2").
	journalMagic2     = "ELIJRNL2"
	journal2HeaderLen = 80
	journal2ADLen     = 56 // magic, generation, count, reserved, root
	journal2RootOff   = 24
	journal2NonceOff  = 56
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

// journal seals and opens the journal region, with the journal key of keys. It is used by
// one goroutine at a time (the one running a commit, or Open's recovery), so its buffer
// needs no lock.
type journal struct {
	keys   *keyring
	rand   io.Reader
	off    int64 // JournalOffset
	length int64 // J, or a slot's J/2 in version 2
	seq    uint64
	buf    []byte

	// Version 2: the generation of the newest slot (0: none written yet) and the root it
	// carries.
	v2   bool
	l    Layout
	gen  uint64
	root [32]byte
}

func newJournal(keys *keyring, l Layout, rand io.Reader) *journal {
	return &journal{keys: keys, rand: rand, off: l.JournalOffset(), length: l.JournalSlotLen(), v2: l.Tree(), l: l}
}

// encode seals entries into the next journal write and returns its bytes and where they
// go: in version 1 the journal region, under the next sequence number; in version 2 the
// slot of the next generation, which carries root.
func (j *journal) encode(entries []journalEntry, root [32]byte) ([]byte, int64, error) {
	if j.v2 {
		return j.encode2(entries, root)
	}
	b, err := j.encode1(entries)
	return b, j.off, err
}

// encode2 builds the sealed version 2 slot for entries and root under the next generation,
// and returns the bytes and where to write them (slot generation mod 2). The generation
// counts as taken even if the write then fails: the device stops then anyway.
func (j *journal) encode2(entries []journalEntry, root [32]byte) ([]byte, int64, error) {
	n := journal2HeaderLen + len(entries)*journalEntryLen + journalTagLen
	if int64(n) > j.length {
		return nil, 0, fmt.Errorf("journal: %d entries do not fit %d bytes", len(entries), j.length)
	}
	if cap(j.buf) < n {
		j.buf = make([]byte, n)
	}
	b := j.buf[:n]
	clear(b[:journal2HeaderLen])
	j.gen++
	j.root = root
	copy(b, journalMagic2)
	binary.LittleEndian.PutUint64(b[8:], j.gen)
	binary.LittleEndian.PutUint32(b[16:], uint32(len(entries)))
	copy(b[journal2RootOff:], root[:])
	nonce := b[journal2NonceOff : journal2NonceOff+chacha20poly1305.NonceSizeX]
	if _, err := io.ReadFull(j.rand, nonce); err != nil {
		return nil, 0, fmt.Errorf("journal nonce: %w", err)
	}
	p := b[journal2HeaderLen:journal2HeaderLen]
	for _, e := range entries {
		p = binary.LittleEndian.AppendUint64(p, e.index)
		p = append(p, e.old[:]...)
		p = append(p, e.new[:]...)
	}
	j.keys.cur.sealJournal(p[:0], nonce, p, b[:journal2ADLen])
	return b, j.l.JournalSlotOffset(int(j.gen % 2)), nil
}

// encode1 builds the sealed version 1 journal for entries under the next sequence number
// and returns the bytes to write at the journal's offset.
func (j *journal) encode1(entries []journalEntry) ([]byte, error) {
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
	j.keys.cur.sealJournal(p[:0], nonce, p, b[:journalADLen])
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
	plain, err := j.keys.openJournal(b[journalHeaderLen:], nonce, b[:journalADLen])
	if err != nil {
		return nil, fmt.Errorf("%w (sequence %d, %d entries)", errJournalTorn, seq, count)
	}
	if !bytes.Equal(b[20:24], []byte{0, 0, 0, 0}) {
		return nil, fmt.Errorf("journal %d: reserved bytes are not zero", seq)
	}
	j.seq = seq
	return decodeEntries(plain, int(count), seq, sectors)
}

// decodeEntries checks and decodes count entries of an opened journal.
func decodeEntries(plain []byte, count int, seq, sectors uint64) ([]journalEntry, error) {
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

// slotState is what one version 2 journal slot holds.
type slotState struct {
	state   string // "zero", "torn" or "open"
	detail  string
	gen     uint64
	root    [32]byte
	entries []journalEntry
}

// slotHeader reads slot k's header: its magic, generation, count and root, none of them
// authenticated yet. ok is false for a slot without the magic.
func slotHeader(r io.ReaderAt, l Layout, k int) (h [journal2HeaderLen]byte, ok bool, err error) {
	if _, err := r.ReadAt(h[:], l.JournalSlotOffset(k)); err != nil {
		return h, false, fmt.Errorf("read journal slot %d: %w", k, err)
	}
	return h, string(h[:8]) == journalMagic2, nil
}

// readSlot loads and opens version 2 slot k.
func (j *journal) readSlot(r io.ReaderAt, k int, sectors uint64) (slotState, error) {
	h, ok, err := slotHeader(r, j.l, k)
	if err != nil {
		return slotState{}, err
	}
	if !ok {
		if h == [journal2HeaderLen]byte{} {
			return slotState{state: "zero"}, nil
		}
		return slotState{state: "torn", detail: "no journal magic"}, nil
	}
	gen := binary.LittleEndian.Uint64(h[8:])
	count := binary.LittleEndian.Uint32(h[16:])
	if int64(count) > (j.length-journal2HeaderLen-journalTagLen)/journalEntryLen {
		return slotState{state: "torn", detail: fmt.Sprintf("entry count %d exceeds the slot", count)}, nil
	}
	n := int(count)*journalEntryLen + journalTagLen
	if cap(j.buf) < journal2HeaderLen+n {
		j.buf = make([]byte, journal2HeaderLen+n)
	}
	b := j.buf[:journal2HeaderLen+n]
	copy(b, h[:])
	if _, err := r.ReadAt(b[journal2HeaderLen:], j.l.JournalSlotOffset(k)+journal2HeaderLen); err != nil {
		return slotState{}, fmt.Errorf("read journal slot %d entries: %w", k, err)
	}
	nonce := b[journal2NonceOff : journal2NonceOff+chacha20poly1305.NonceSizeX]
	plain, err := j.keys.openJournal(b[journal2HeaderLen:], nonce, b[:journal2ADLen])
	if err != nil {
		return slotState{state: "torn", detail: fmt.Sprintf("generation %d, %d entries: does not open", gen, count)}, nil
	}
	// Opened: our own writing from here on, so anything odd refuses the attach.
	if !bytes.Equal(b[20:24], []byte{0, 0, 0, 0}) {
		return slotState{}, fmt.Errorf("journal slot %d: reserved bytes are not zero", k)
	}
	switch {
	case gen == 0:
		// Generation 0 stands for "no slot written"; the first slot written is 1.
		return slotState{}, fmt.Errorf("%w: journal slot %d holds generation 0, which no slot may hold (the first written is 1)", ErrFreshness, k)
	case gen%2 != uint64(k):
		return slotState{}, fmt.Errorf("%w: journal slot %d holds generation %d, which belongs in slot %d", ErrFreshness, k, gen, gen%2)
	}
	entries, err := decodeEntries(plain, int(count), gen, sectors)
	if err != nil {
		return slotState{}, err
	}
	st := slotState{state: "open", gen: gen, entries: entries}
	copy(st.root[:], h[journal2RootOff:])
	return st, nil
}

// read2 opens both slots and returns the newest that opens, or, when neither does,
// generation 0 with the zero root (a volume whose first commit never completed its
// journal write). torn says whether some slot holds a journal that does not open.
func (j *journal) read2(r io.ReaderAt, sectors uint64) (cur slotState, torn string, err error) {
	var s [2]slotState
	for k := range s {
		if s[k], err = j.readSlot(r, k, sectors); err != nil {
			return slotState{}, "", err
		}
		if s[k].state == "torn" {
			torn = s[k].detail
		}
	}
	switch {
	case s[0].state == "open" && s[1].state == "open":
		cur = s[0]
		if s[1].gen > s[0].gen {
			cur = s[1]
		}
	case s[0].state == "open":
		cur = s[0]
	case s[1].state == "open":
		cur = s[1]
	default:
		cur = slotState{state: "zero"}
	}
	j.gen, j.root = cur.gen, cur.root
	return cur, torn, nil
}

// Freshness is what an authenticated volume of format version 2 says about itself: the
// generation of its newest journal slot and the root of its hash tree.
type Freshness struct {
	Generation uint64
	Root       [32]byte
}

// PeekFreshness reads the generation and root of the newest journal slot of a version 2
// volume without the key (eli dump): neither is verified, since only the journal key
// opens a slot, and a slot torn by a crash is not told apart from a good one. ok is false
// when no slot has a journal header (a volume never written) or the layout is not
// version 2.
func PeekFreshness(r io.ReaderAt, l Layout) (f Freshness, ok bool, err error) {
	if !l.Tree() {
		return Freshness{}, false, nil
	}
	for k := range 2 {
		h, found, err := slotHeader(r, l, k)
		if err != nil {
			return Freshness{}, false, err
		}
		if !found {
			continue
		}
		if gen := binary.LittleEndian.Uint64(h[8:]); !ok || gen > f.Generation {
			f.Generation = gen
			copy(f.Root[:], h[journal2RootOff:])
			ok = true
		}
	}
	return f, ok, nil
}

package blockdev

import (
	"crypto/cipher"
	"errors"
	"fmt"

	"github.com/elidisk/eli/internal/wipe"
	"github.com/elidisk/eli/sector"

	"golang.org/x/crypto/chacha20poly1305"
)

// keyring is every key an open device seals and opens with, in one place: nothing else
// in the device holds a key or a cipher made from one, so that they can be wiped, or
// replaced, at one point while no request runs (the Device's gate held exclusively).
//
// During a re-encryption (reencrypt.go) it holds two sets: the current one, which seals
// everything written, and the previous one (prev), which only opens what was sealed
// before the re-encryption began and has not been moved yet.
type keyring struct {
	cur  keySet
	prev *keySet // nil unless a re-encryption is under way
}

// keySet is the keys of one master key.
type keySet struct {
	// codec seals and opens sectors under the data key. It is the caller's
	// (Config.Codec, Reencrypt.Prev): the device never wipes it.
	codec sector.Codec
	// The codec's runs of sectors: meta in authenticated modes, plain in
	// length-preserving ones (the other is nil).
	meta  sector.MetaRunner
	plain sector.Runner
	// journal seals and opens the journal (authenticated modes): the device's own copy
	// of the journal key, wiped by Close.
	journal cipher.AEAD
}

// newKeySet takes codec's runners, refusing a codec without the one its kind needs.
func newKeySet(c sector.Codec) (keySet, error) {
	runs, _ := c.(sector.MetaRunner)
	plainRuns, _ := c.(sector.Runner)
	if (c.MetaSize() > 0 && runs == nil) || (c.MetaSize() == 0 && plainRuns == nil) {
		return keySet{}, fmt.Errorf("codec %s does not take runs of sectors (sector.MetaRunner or sector.Runner)", c.Mode())
	}
	return keySet{codec: c, meta: runs, plain: plainRuns}, nil
}

// setJournalKey makes the journal's cipher from a copy of key.
func (k *keySet) setJournalKey(key []byte) error {
	if len(key) != JournalKeySize {
		return fmt.Errorf("journal key is %d bytes, want %d", len(key), JournalKeySize)
	}
	a, err := chacha20poly1305.NewX(key)
	if err != nil {
		return fmt.Errorf("journal key: %w", err)
	}
	k.journal = a
	return nil
}

// sealJournal and openJournal are the journal AEAD's Seal and Open between two
// wipe.Stack calls: x/crypto keeps the journal key's words on the stack while it seals
// or opens, and a stack that grows or shrinks later would carry them where no wipe
// reaches (internal/wipe's Stack).
func (k *keySet) sealJournal(dst, nonce, plaintext, ad []byte) []byte {
	wipe.Stack()
	out := k.journal.Seal(dst, nonce, plaintext, ad)
	wipe.Stack()
	return out
}

func (k *keySet) openJournal(dst, nonce, sealed, ad []byte) ([]byte, error) {
	wipe.Stack()
	out, err := k.journal.Open(dst, nonce, sealed, ad)
	wipe.Stack()
	return out, err
}

// wipeJournal zeroes the journal key inside the x/crypto AEAD (see sector's aead.go for
// why reflection: the package offers no other way).
func (k *keySet) wipeJournal() {
	if k.journal != nil {
		wipe.AEADKey(k.journal)
		k.journal = nil
	}
}

// wipeJournals zeroes the journal keys of both sets.
func (k *keyring) wipeJournals() {
	k.cur.wipeJournal()
	if k.prev != nil {
		k.prev.wipeJournal()
	}
}

// forgetPrevious drops the previous set, wiping its journal key (its codec is the
// caller's).
func (k *keyring) forgetPrevious() {
	if k.prev != nil {
		k.prev.wipeJournal()
		k.prev = nil
	}
}

// errJournalKey: a journal that opens under neither journal key.
var errJournalKey = errors.New("journal does not open under the journal key")

// openJournal opens sealed (ciphertext and tag, which it overwrites) under the current
// journal key, or else the previous one: a journal written before a re-encryption began
// is sealed under the previous key. x/crypto clears what it fails to open in place, so
// with two keys the first try opens a copy.
func (k *keyring) openJournal(sealed, nonce, ad []byte) ([]byte, error) {
	if k.prev == nil || k.prev.journal == nil {
		p, err := k.cur.openJournal(sealed[:0], nonce, sealed, ad)
		if err != nil {
			return nil, errJournalKey
		}
		return p, nil
	}
	if p, err := k.cur.openJournal(nil, nonce, sealed, ad); err == nil {
		return p, nil
	}
	p, err := k.prev.openJournal(sealed[:0], nonce, sealed, ad)
	if err != nil {
		return nil, errJournalKey
	}
	return p, nil
}

package blockdev

import (
	"crypto/cipher"
	"fmt"

	"github.com/elidisk/eli/internal/wipe"
	"github.com/elidisk/eli/sector"

	"golang.org/x/crypto/chacha20poly1305"
)

// keyring is every key an open device seals and opens with, in one place: nothing else
// in the device holds a key or a cipher made from one, so that they can be wiped, or
// replaced, at one point while no request runs (the Device's gate held exclusively).
type keyring struct {
	// codec seals and opens sectors under the data key. It is the caller's
	// (Config.Codec): the device never wipes it.
	codec sector.Codec
	// The codec's runs of sectors: meta in authenticated modes, plain in
	// length-preserving ones (the other is nil).
	meta  sector.MetaRunner
	plain sector.Runner
	// journal seals and opens the journal (authenticated modes): the device's own copy
	// of Config.JournalKey, wiped by Close.
	journal cipher.AEAD
}

// setJournalKey makes the journal's cipher from a copy of key.
func (k *keyring) setJournalKey(key []byte) error {
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

// wipeJournal zeroes the journal key inside the x/crypto AEAD (see sector's aead.go for
// why reflection: the package offers no other way).
func (k *keyring) wipeJournal() {
	if k.journal != nil {
		wipe.AEADKey(k.journal)
		k.journal = nil
	}
}

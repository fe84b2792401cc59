package keys

import (
	"errors"
	"fmt"

	"github.com/elidisk/eli/layout"
)

// Sentinel errors. Every error this package returns for one of these conditions wraps the
// sentinel, so callers match with errors.Is; the error's text says what exactly is wrong.
var (
	// ErrNotELI: no copy of the provider carries the eli magic.
	ErrNotELI = errors.New("not an eli provider")
	// ErrVersion: an eli header of a format version this code does not read.
	ErrVersion = errors.New("eli header version is not supported")
	// ErrCorrupt: a header copy (or backup) fails its checksum or a sanity check.
	ErrCorrupt = errors.New("eli header is corrupt")
	// ErrStale: a valid header copy that is older than the other one (a warning from Read).
	ErrStale = errors.New("eli header copy is older than the other")
	// ErrTooSmall: the provider cannot hold the layout.
	ErrTooSmall = layout.ErrTooSmall
	// ErrLayout: layout fields that the format does not allow.
	ErrLayout = layout.ErrInvalid
	// ErrWrongKey: no keyslot opens with the given credentials.
	ErrWrongKey = errors.New("wrong passphrase or keyfile")
	// ErrHeaderTampered: the header MAC does not verify under the unlocked master key.
	ErrHeaderTampered = errors.New("header fields were modified")
	// ErrNoCredentials: neither a passphrase nor a keyfile was given.
	ErrNoCredentials = errors.New("no passphrase or keyfile given")
	// ErrNoKeys: the header has no active keyslot (killed, or the last slot deleted).
	ErrNoKeys = errors.New("no active keyslot: the volume's keys were destroyed")
	// ErrNoFreeSlot: SetKey found every keyslot in use.
	ErrNoFreeSlot = errors.New("no free keyslot")
	// ErrSlotEmpty: the named keyslot is not active.
	ErrSlotEmpty = errors.New("keyslot is empty")
	// ErrSlotRange: a keyslot index outside 0..NumSlots-1.
	ErrSlotRange = errors.New("keyslot index out of range")
	// ErrLastSlot: DelKey would delete the last active keyslot and was not forced.
	ErrLastSlot = errors.New("refusing to delete the last active keyslot")
	// ErrKDFParams: Argon2id parameters outside what eli accepts.
	ErrKDFParams = errors.New("KDF parameters out of range")
	// ErrKDFLimit: a keyslot's Argon2id parameters are within the format's bounds but
	// beyond the KDFLimits of this unlock.
	ErrKDFLimit = errors.New("KDF parameters beyond the limits")
	// ErrOtherVolume: a backup whose volume ID differs from the provider's current header.
	ErrOtherVolume = errors.New("header belongs to another volume")
	// ErrSizeMismatch: a backup made when the provider had another size.
	ErrSizeMismatch = errors.New("header was written for a provider of another size")
)

// kindError carries a precise message and the sentinel it is an instance of.
type kindError struct {
	kind error
	msg  string
}

func (e *kindError) Error() string { return e.msg }
func (e *kindError) Unwrap() error { return e.kind }

func newError(kind error, format string, a ...any) error {
	return &kindError{kind: kind, msg: fmt.Sprintf(format, a...)}
}

// kindOf returns the sentinel err is an instance of, or nil for other errors (I/O).
func kindOf(err error) error {
	for _, k := range []error{ErrNotELI, ErrVersion, ErrCorrupt, ErrTooSmall, ErrStale} {
		if errors.Is(err, k) {
			return k
		}
	}
	return nil
}

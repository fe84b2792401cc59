package keys

import (
	"bytes"
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/elidisk/eli/internal/wipe"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"

	"golang.org/x/crypto/chacha20poly1305"
)

// Re-encryption in the header (docs/format.md, "Re-encryption"): a key epoch that counts
// the re-encryptions a volume has begun, and while one is under way the mode and master
// key of the sectors not yet moved (the previous key, sealed under a key derived from the
// current one) and a checkpoint of the sweep. The keyslots wrap the current master key
// only, from the start of the re-encryption on. All of it lies in what was the header's
// reserved room, which an eli without re-encryption refuses unless it is zero: such an
// eli cannot open a volume that was ever re-encrypted. The flags field stays 0: it is in
// every keyslot's additional data, so ending a re-encryption could not change it without
// the credentials of every keyslot.

// Byte offsets of the re-encryption area, in the header's reserved room.
const (
	offEpoch     = offReserved                                            // 1664: key epoch (u64)
	offPrevMode  = 1672                                                   // previous mode (u8), then 7 reserved bytes
	offCursor    = 1680                                                   // checkpoint (u64)
	offPrevNonce = 1688                                                   // XChaCha20-Poly1305 nonce (24)
	offPrevKey   = 1712                                                   // previous master key, sealed (64 + 16)
	offAreaEnd   = offPrevKey + MasterKeySize + chacha20poly1305.Overhead // 1792
	offPrevADEnd = offPrevNonce                                           // the area's fields in the AD: [1664, 1688)
	infoPrevious = "eli/v1/previous-key"
)

// Errors of re-encryption.
var (
	// ErrReencrypting: the operation needs a volume that is not being re-encrypted (or a
	// second re-encryption was asked for while one is under way).
	ErrReencrypting = errors.New("a re-encryption is under way")
	// ErrNotReencrypting: the header holds no re-encryption to checkpoint or finish.
	ErrNotReencrypting = errors.New("no re-encryption is under way")
	// ErrSlotCredentials: keyslots whose credentials were not given would be lost.
	ErrSlotCredentials = errors.New("credentials missing for keyslots")
	// ErrModeChange: a change of mode that re-encryption cannot make in place.
	ErrModeChange = errors.New("mode change not possible in place")
	// ErrOldKeys: a backup that holds keys the volume's data is no longer under.
	ErrOldKeys = errors.New("header backup holds an older master key")
	// ErrHeaderChanged: a prepared re-encryption whose volume's header was written since
	// it was prepared, or that would change more than a start changes.
	ErrHeaderChanged = errors.New("the header changed since the re-encryption was prepared")
)

// Reencryption is what a header says about re-encryption.
type Reencryption struct {
	// Epoch counts the re-encryptions begun on the volume: 0 for one never re-encrypted.
	// The current master key is the epoch's; a backup of a lower epoch holds a key the
	// data is no longer under.
	Epoch uint64
	// Active: a re-encryption is under way, and the header holds the previous master key.
	Active bool
	// PrevMode is the mode of the sectors not moved yet (Active only).
	PrevMode sector.Mode
	// Cursor is the sweep's last checkpoint (Active only): every sector below it was under
	// the current key when it was written.
	Cursor uint64
}

// Reencryption reports the header's re-encryption state.
func (h *Header) Reencryption() Reencryption {
	le := binary.LittleEndian
	r := Reencryption{Epoch: le.Uint64(h.raw[offEpoch:])}
	if h.raw[offPrevMode] != 0 {
		r.Active = true
		r.PrevMode = sector.Mode(h.raw[offPrevMode])
		r.Cursor = le.Uint64(h.raw[offCursor:])
	}
	return r
}

// macInput is what the header MAC covers: bytes [0, 96) with the sequence zeroed, then
// the key epoch (8 bytes) unless it is 0, so that the MAC of a volume never re-encrypted
// is what it always was.
func macInput(raw *[HeaderSize]byte) []byte {
	in := authenticatedPrefix(raw, offMAC)
	if binary.LittleEndian.Uint64(raw[offEpoch:]) != 0 {
		in = append(in, raw[offEpoch:offEpoch+8]...)
	}
	return in
}

// checkReencryption is Decode's check of flags and the re-encryption area.
func checkReencryption(b []byte, l Layout) error {
	le := binary.LittleEndian
	if f := le.Uint32(b[offFlags:]); f != 0 {
		return fmt.Errorf("unknown flags %#x", f)
	}
	if !allZero(b[offAreaEnd:offChecksum]) {
		return fmt.Errorf("reserved bytes %d..%d are not zero", offAreaEnd, offChecksum)
	}
	if b[offPrevMode] == 0 {
		if !allZero(b[offPrevMode:offAreaEnd]) {
			return fmt.Errorf("re-encryption area %d..%d is not zero, but no re-encryption is under way", offPrevMode, offAreaEnd)
		}
		return nil
	}
	if le.Uint64(b[offEpoch:]) == 0 {
		return errors.New("a re-encryption is under way at key epoch 0")
	}
	prev := sector.Mode(b[offPrevMode])
	if err := InPlace(prev, l.Mode); err != nil {
		return fmt.Errorf("re-encryption from %s: %v", prev, err)
	}
	if !allZero(b[offPrevMode+1 : offCursor]) {
		return errors.New("reserved bytes after the previous mode are not zero")
	}
	if c := le.Uint64(b[offCursor:]); c > l.Sectors {
		return fmt.Errorf("re-encryption checkpoint %d is past the last sector (%d)", c, l.Sectors)
	}
	return nil
}

// InPlace reports whether sectors of mode from can be re-encrypted in place into mode to:
// the layout must not change. An authenticated mode keeps its records (key rotation only),
// and a length-preserving mode changes into another length-preserving one. Errors wrap
// ErrModeChange.
func InPlace(from, to sector.Mode) error {
	switch {
	case !from.Valid() || !to.Valid():
		return newError(ErrModeChange, "unknown mode (%s to %s)", from, to)
	case from.Authenticated() != to.Authenticated():
		return newError(ErrModeChange, "%s and %s store sectors differently (one keeps a record per sector, the other does not): make a new volume with eli init and copy the data", from, to)
	case from.Authenticated() && from != to:
		return newError(ErrModeChange, "%s cannot become %s in place", from, to)
	}
	return nil
}

// previousAEAD is the cipher that seals the previous master key: XChaCha20-Poly1305 under
// HKDF(current master key, volume ID, "eli/v1/previous-key").
func previousAEAD(mk *MasterKey, fn func(a aeadLike) error) error {
	k := mk.derive(infoPrevious, chacha20poly1305.KeySize)
	defer k.Wipe()
	a, err := chacha20poly1305.NewX(k.Bytes())
	if err != nil {
		return err
	}
	defer wipe.AEADKey(a)
	return fn(a)
}

type aeadLike interface {
	Seal(dst, nonce, plaintext, ad []byte) []byte
	Open(dst, nonce, ciphertext, ad []byte) ([]byte, error)
}

// previousAD is the additional data of the sealed previous key: header bytes [0, 80) with
// the sequence zeroed, then the area's bytes [1664, 1688) (epoch, previous mode, cursor).
func previousAD(raw *[HeaderSize]byte) []byte {
	return append(authenticatedPrefix(raw, slotADFields), raw[offEpoch:offPrevADEnd]...)
}

// sealPrevious seals prev into raw's area under mk, with a fresh nonce; every other field
// of raw's first 80 bytes and of the area must be final.
func sealPrevious(raw *[HeaderSize]byte, mk, prev *MasterKey, rnd io.Reader) error {
	if _, err := io.ReadFull(rnd, raw[offPrevNonce:offPrevKey]); err != nil {
		return fmt.Errorf("re-encryption nonce: %w", err)
	}
	return previousAEAD(mk, func(a aeadLike) error {
		a.Seal(raw[offPrevKey:offPrevKey], raw[offPrevNonce:offPrevKey], prev.key.Bytes(), previousAD(raw))
		return nil
	})
}

// PreviousKey unseals the master key of the sectors a re-encryption has not moved yet,
// with mk, the current master key (from Unlock), which it verifies first. Errors wrap
// ErrNotReencrypting, ErrWrongKey or ErrHeaderTampered.
func (h *Header) PreviousKey(mk *MasterKey) (*MasterKey, error) {
	if err := h.Verify(mk); err != nil {
		return nil, err
	}
	if !h.Reencryption().Active {
		return nil, ErrNotReencrypting
	}
	out := NewSecret(MasterKeySize)
	err := previousAEAD(mk, func(a aeadLike) error {
		_, err := a.Open(out.Bytes()[:0], h.raw[offPrevNonce:offPrevKey], h.raw[offPrevKey:offAreaEnd], previousAD(&h.raw))
		return err
	})
	if err != nil {
		out.Wipe()
		return nil, newError(ErrHeaderTampered, "the re-encryption area does not open under the current master key (changed on the provider?)")
	}
	return &MasterKey{volumeID: mk.volumeID, key: out}, nil
}

// ReencryptOptions say how BeginReencrypt re-wraps the keyslots.
type ReencryptOptions struct {
	// Mode is the mode the volume moves to (InPlace must allow it); zero keeps the mode.
	Mode sector.Mode
	// Slots are the credentials of keyslots to keep, by index. Every active keyslot not
	// named here is refused (ErrSlotCredentials) unless DropOthers.
	Slots map[int]Credentials
	// DropOthers empties the active keyslots not in Slots.
	DropOthers bool
	// Limits bound the Argon2id derivations that check each credential (zero:
	// DefaultKDFLimits).
	Limits KDFLimits
}

// BeginReencrypt starts a re-encryption: it makes a new random master key and writes the
// header with it (both copies, in the crash-safe order): every kept keyslot wraps the new
// key under its own credentials and KDF parameters (each checked against the slot first,
// with fresh salt and nonce), the key epoch grows by one, and the re-encryption area
// holds the previous mode and master key (mk, which it verifies) sealed under the new
// one, with the checkpoint at 0. It returns the new master key; the caller wipes it.
//
// A volume whose header already says a re-encryption is under way is refused
// (ErrReencrypting): resume that one. Other errors wrap ErrSlotCredentials,
// ErrModeChange, ErrSlotEmpty, ErrWrongKey or ErrKDFLimit, or are I/O errors.
func BeginReencrypt(p provider.Provider, mk *MasterKey, o ReencryptOptions) (*MasterKey, error) {
	return beginReencrypt(p, mk, o, rand.Reader)
}

func beginReencrypt(p provider.Provider, mk *MasterKey, o ReencryptOptions, rnd io.Reader) (*MasterKey, error) {
	h, err := Read(p)
	if err != nil {
		return nil, err
	}
	pr, err := prepareReencrypt(h, mk, o, rnd)
	if err != nil {
		return nil, err
	}
	if err := CommitReencrypt(p, pr); err != nil {
		pr.Wipe()
		return nil, err
	}
	return pr.next, nil
}

// PreparedReencrypt is the start of a re-encryption computed away from the provider, by
// the process that holds the credentials (the Argon2id work): the header to write and
// the new master key. An attached volume's server writes it (CommitReencrypt), since it
// holds the provider. Wipe it when done.
type PreparedReencrypt struct {
	raw  [HeaderSize]byte // the new header; its sequence is the one of the header it was made from
	next *MasterKey
}

// PrepareReencrypt is BeginReencrypt without the write: it checks every kept keyslot's
// credentials against h (the volume's header, read by the caller) and mk, makes a new
// master key and the header that starts the re-encryption. Nothing is written.
func PrepareReencrypt(h *Header, mk *MasterKey, o ReencryptOptions) (*PreparedReencrypt, error) {
	return prepareReencrypt(h, mk, o, rand.Reader)
}

func prepareReencrypt(h *Header, mk *MasterKey, o ReencryptOptions, rnd io.Reader) (*PreparedReencrypt, error) {
	if err := h.Verify(mk); err != nil {
		return nil, err
	}
	r := h.Reencryption()
	if r.Active {
		return nil, newError(ErrReencrypting, "a re-encryption from %s is under way (checkpoint at sector %d of %d): resume it instead of starting another", r.PrevMode, r.Cursor, h.Sectors)
	}
	mode := o.Mode
	if mode == sector.ModeInvalid {
		mode = h.Mode
	}
	if err := InPlace(h.Mode, mode); err != nil {
		return nil, err
	}
	lim := o.Limits
	if lim == (KDFLimits{}) {
		lim = DefaultKDFLimits()
	}
	keep, err := slotsToKeep(h, o, lim, mk)
	if err != nil {
		return nil, err
	}
	next, err := generateMasterKey(rnd)
	if err != nil {
		return nil, err
	}
	next.volumeID = mk.volumeID
	pr := &PreparedReencrypt{raw: h.raw, next: next}
	raw := &pr.raw
	le := binary.LittleEndian
	raw[offMode] = byte(mode)
	le.PutUint64(raw[offEpoch:], r.Epoch+1)
	raw[offPrevMode] = byte(h.Mode)
	le.PutUint64(raw[offCursor:], 0)
	clear(raw[offSlots:offReserved])
	for _, i := range keep {
		if err := sealSlot(raw, i, next, o.Slots[i], h.slot(i).KDF, rnd); err != nil {
			pr.Wipe()
			return nil, fmt.Errorf("keyslot %d: %w", i, err)
		}
	}
	if err := sealPrevious(raw, next, mk, rnd); err != nil {
		pr.Wipe()
		return nil, err
	}
	setMAC(raw, next)
	setSequence(raw, h.Sequence)
	setChecksum(raw)
	return pr, nil
}

// Header is the prepared header's bytes (HeaderSize, no secret: the keyslots and the
// previous key are sealed), for ParsePrepared in the process that writes it.
func (pr *PreparedReencrypt) Header() []byte { return bytes.Clone(pr.raw[:]) }

// Key is the new master key, valid until Wipe.
func (pr *PreparedReencrypt) Key() *MasterKey { return pr.next }

// Wipe zeroes the new master key.
func (pr *PreparedReencrypt) Wipe() {
	if pr != nil {
		pr.next.Wipe()
	}
}

// ParsePrepared rebuilds a PreparedReencrypt from Header's bytes and the new master
// key's (which it copies into locked memory; the caller wipes its own copy). It checks
// the bytes as a header and the key against them; CommitReencrypt checks the rest
// against the provider.
func ParsePrepared(header, key []byte) (*PreparedReencrypt, error) {
	h, err := Decode(header)
	if err != nil {
		return nil, fmt.Errorf("prepared re-encryption header: %w", err)
	}
	next, err := NewMasterKey(h.VolumeID, key)
	if err != nil {
		return nil, err
	}
	if err := h.Verify(next); err != nil {
		next.Wipe()
		return nil, fmt.Errorf("prepared re-encryption header: %w", err)
	}
	return &PreparedReencrypt{raw: h.raw, next: next}, nil
}

// preparedMayChange are the header byte ranges a re-encryption's start may change: the
// sequence, the mode, the MAC, the keyslots and the re-encryption area, and the checksum.
var preparedMayChange = [][2]int{{offSequence, offSequence + 8}, {offMode, offMode + 1}, {offMAC, offAreaEnd}, {offChecksum, HeaderSize}}

// CommitReencrypt writes a prepared re-encryption's header on p (both copies, in the
// crash-safe order). It refuses (ErrHeaderChanged) unless p's header is still the one
// the start was prepared from, but for what a start changes, and checks that the start
// is one (ErrHeaderTampered otherwise): the next key epoch, the previous mode and
// master key those of p's header (the previous key sealed in the prepared header must
// verify p's header), and the checkpoint at 0. Whoever prepares a start must so have
// unlocked the volume. A re-encryption under way is refused (ErrReencrypting).
func CommitReencrypt(p provider.Provider, pr *PreparedReencrypt) error {
	h, err := Read(p)
	if err != nil {
		return err
	}
	if r := h.Reencryption(); r.Active {
		return newError(ErrReencrypting, "a re-encryption from %s is under way (checkpoint at sector %d of %d): resume it instead of starting another", r.PrevMode, r.Cursor, h.Sectors)
	}
	if seq := binary.LittleEndian.Uint64(pr.raw[offSequence:]); seq != h.Sequence {
		return newError(ErrHeaderChanged, "the header was written since the re-encryption was prepared (sequence %d, prepared from %d): prepare it again", h.Sequence, seq)
	}
	at := 0
	for _, r := range preparedMayChange {
		if !bytes.Equal(h.raw[at:r[0]], pr.raw[at:r[0]]) {
			return newError(ErrHeaderChanged, "the prepared header differs from the volume's in bytes %d..%d, which a re-encryption keeps", at, r[0])
		}
		at = r[1]
	}
	next, err := decode(pr.raw[:], "")
	if err != nil {
		return fmt.Errorf("prepared re-encryption header: %w", err)
	}
	if err := next.Verify(pr.next); err != nil {
		return err
	}
	want := Reencryption{Epoch: h.Reencryption().Epoch + 1, Active: true, PrevMode: h.Mode}
	if got := next.Reencryption(); got != want {
		return newError(ErrHeaderTampered, "the prepared header does not start re-encryption %d from %s at sector 0 (it says %+v)", want.Epoch, h.Mode, got)
	}
	if err := InPlace(h.Mode, next.Mode); err != nil {
		return err
	}
	prev, err := next.PreviousKey(pr.next)
	if err != nil {
		return err
	}
	err = h.Verify(prev)
	prev.Wipe()
	if err != nil {
		return newError(ErrHeaderTampered, "the prepared header's previous key is not the volume's master key")
	}
	if next.ActiveSlots() == 0 {
		return newError(ErrSlotCredentials, "no keyslot would open the new master key")
	}
	raw := pr.raw
	return writeBoth(p, h, &raw, h.Sequence)
}

// slotsToKeep checks o.Slots against h's keyslots, each by opening it (it must give mk),
// and returns the slots to re-wrap, in order.
func slotsToKeep(h *Header, o ReencryptOptions, lim KDFLimits, mk *MasterKey) ([]int, error) {
	var keep, missing []int
	for i := range NumSlots {
		info := h.slot(i)
		_, given := o.Slots[i]
		switch {
		case given && !info.Active:
			return nil, newError(ErrSlotEmpty, "credentials were given for keyslot %d, which is empty", i)
		case !info.Active:
		case given:
			keep = append(keep, i)
		case !o.DropOthers:
			missing = append(missing, i)
		}
	}
	for i := range o.Slots {
		if i < 0 || i >= NumSlots {
			return nil, newError(ErrSlotRange, "keyslot %d is out of range (0..%d)", i, NumSlots-1)
		}
	}
	if len(missing) > 0 {
		var names []string
		for _, i := range missing {
			names = append(names, fmt.Sprintf("%d (takes %s)", i, h.slot(i).Uses))
		}
		return nil, newError(ErrSlotCredentials, "keyslot %s would not open the new master key: give its credentials to keep it, or drop it explicitly", strings.Join(names, ", "))
	}
	if len(keep) == 0 {
		return nil, newError(ErrSlotCredentials, "no keyslot would open the new master key")
	}
	budget := lim.WorkKiB
	for _, i := range keep {
		c, info := o.Slots[i], h.slot(i)
		if err := c.check(); err != nil {
			return nil, fmt.Errorf("keyslot %d: %w", i, err)
		}
		if info.Uses != c.Uses() {
			return nil, newError(ErrWrongKey, "wrong passphrase or keyfile for keyslot %d: it takes %s, but %s was given", i, info.Uses, c.Uses())
		}
		if err := lim.Check(info.KDF); err != nil {
			return nil, fmt.Errorf("keyslot %d: %w", i, err)
		}
		if info.KDF.work() > budget {
			return nil, newError(ErrKDFLimit, "keyslot %d: checking every keyslot's credentials needs more Argon2id work than the limit of %s × passes", i, kib(lim.WorkKiB))
		}
		budget -= info.KDF.work()
		ikm := c.ikm()
		key := openSlot(&h.raw, i, info, ikm)
		ikm.Wipe()
		if key == nil {
			return nil, newError(ErrWrongKey, "wrong passphrase or keyfile for keyslot %d", i)
		}
		same := subtle.ConstantTimeCompare(key.Bytes(), mk.key.Bytes()) == 1
		key.Wipe()
		if !same {
			return nil, newError(ErrWrongKey, "keyslot %d opens another master key", i)
		}
	}
	slices.Sort(keep)
	return keep, nil
}

// SetReencryptCursor records the sweep's checkpoint: every sector below cursor is under
// the current key (mk, which it verifies). The checkpoint only moves forward.
func SetReencryptCursor(p provider.Provider, mk *MasterKey, cursor uint64) error {
	return setReencryptCursor(p, mk, cursor, rand.Reader)
}

func setReencryptCursor(p provider.Provider, mk *MasterKey, cursor uint64, rnd io.Reader) error {
	return update(p, func(h *Header, raw *[HeaderSize]byte) error {
		prev, err := h.PreviousKey(mk)
		if err != nil {
			return err
		}
		defer prev.Wipe()
		r := h.Reencryption()
		if cursor > h.Sectors {
			return fmt.Errorf("re-encryption checkpoint %d is past the last sector (%d)", cursor, h.Sectors)
		}
		if cursor < r.Cursor {
			return fmt.Errorf("re-encryption checkpoint %d is behind the recorded one (%d)", cursor, r.Cursor)
		}
		binary.LittleEndian.PutUint64(raw[offCursor:], cursor)
		return sealPrevious(raw, mk, prev, rnd)
	})
}

// FinishReencrypt ends a re-encryption whose sweep has moved every sector to the current
// key (mk, which it verifies) and made that durable: it writes the header without the
// previous key, keeping the key epoch.
func FinishReencrypt(p provider.Provider, mk *MasterKey) error {
	return update(p, func(h *Header, raw *[HeaderSize]byte) error {
		if err := h.Verify(mk); err != nil {
			return err
		}
		if !h.Reencryption().Active {
			return ErrNotReencrypting
		}
		clearReencryption(raw)
		setMAC(raw, mk)
		return nil
	})
}

// clearReencryption drops the re-encryption area but the epoch.
func clearReencryption(raw *[HeaderSize]byte) { clear(raw[offPrevMode:offAreaEnd]) }

// staleBackup says why a backup holds keys the data is no longer under (nil if it
// does not): an epoch below the provider's, or a re-encryption that has finished since.
func staleBackup(backup, cur Reencryption) error {
	switch {
	case backup.Epoch < cur.Epoch:
		return newError(ErrOldKeys, "the backup is of key epoch %d, but the volume was re-encrypted since (epoch %d): its keyslots open a master key the data is no longer under", backup.Epoch, cur.Epoch)
	case backup.Epoch == cur.Epoch && backup.Active && !cur.Active:
		return newError(ErrOldKeys, "the backup was made during re-encryption %d, which has finished since: it holds the previous master key, which the volume no longer needs", backup.Epoch)
	}
	return nil
}

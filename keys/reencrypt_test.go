package keys

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/elidisk/eli/sector"
)

// twoSlotVolume has slot 0 under "pw0" and slot 3 under a passphrase and a keyfile.
func twoSlotVolume(t *testing.T) (*memProvider, *MasterKey, Credentials) {
	t.Helper()
	p, mk := newVolume(t)
	c3 := Credentials{Passphrase: []byte("pw3"), Keyfiles: [][]byte{[]byte("kf3")}}
	if _, err := SetKey(p, mk, 3, c3, tiny); err != nil {
		t.Fatal(err)
	}
	return p, mk, c3
}

// reencrypting is newVolume halfway through a re-encryption: the provider, the first
// master key and the new one.
func reencrypting(t *testing.T) (*memProvider, *MasterKey, *MasterKey) {
	t.Helper()
	p, old := newVolume(t)
	mk, err := BeginReencrypt(p, old, ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0")}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mk.Wipe)
	return p, old, mk
}

func TestBeginReencrypt(t *testing.T) {
	t.Parallel()
	p, old, c3 := twoSlotVolume(t)
	before := mustRead(t, p)
	if r := before.Reencryption(); r != (Reencryption{}) {
		t.Fatalf("a new volume says %+v", r)
	}
	mk, err := BeginReencrypt(p, old, ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0"), 3: c3}})
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	if bytes.Equal(mk.Bytes(), old.Bytes()) || mk.VolumeID() != old.VolumeID() {
		t.Fatal("the new master key is the old one, or of another volume")
	}
	h := mustRead(t, p)
	if h.Warning != nil {
		t.Fatalf("both copies should be written: %v", h.Warning)
	}
	r := h.Reencryption()
	if !r.Active || r.Epoch != 1 || r.PrevMode != sector.ModeXChaCha20Poly1305 || r.Cursor != 0 {
		t.Fatalf("state %+v", r)
	}
	// Every kept keyslot opens the new key, none the old one.
	mustUnlock(t, p, pass("pw0"), 0, mk)
	mustUnlock(t, p, c3, 3, mk)
	prev, err := h.PreviousKey(mk)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(prev.Bytes(), old.Bytes()) {
		t.Fatal("the previous key is not the old master key")
	}
	prev.Wipe()
	if _, err := h.PreviousKey(old); !errors.Is(err, ErrHeaderTampered) && !errors.Is(err, ErrWrongKey) {
		t.Fatalf("the old key verifies the new header: %v", err)
	}
	if _, err := BeginReencrypt(p, mk, ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0"), 3: c3}}); !errors.Is(err, ErrReencrypting) {
		t.Fatalf("a second re-encryption: %v", err)
	}
	// setkey and resize work under the new key during the re-encryption.
	if _, err := SetKey(p, mk, 5, pass("pw5"), tiny); err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, p, pass("pw5"), 5, mk)

	if err := SetReencryptCursor(p, mk, 200); err != nil {
		t.Fatal(err)
	}
	if c := mustRead(t, p).Reencryption().Cursor; c != 200 {
		t.Fatalf("cursor %d", c)
	}
	for _, bad := range []uint64{100, 501} {
		if err := SetReencryptCursor(p, mk, bad); err == nil {
			t.Fatalf("checkpoint %d accepted", bad)
		}
	}
	if err := SetReencryptCursor(p, old, 300); err == nil {
		t.Fatal("the old key moved the checkpoint")
	}
	if err := FinishReencrypt(p, mk); err != nil {
		t.Fatal(err)
	}
	h = mustRead(t, p)
	if r := h.Reencryption(); r != (Reencryption{Epoch: 1}) {
		t.Fatalf("after the end: %+v", r)
	}
	if !allZero(h.raw[offPrevMode:offChecksum]) {
		t.Fatal("the re-encryption area is not zero after the end")
	}
	if _, err := h.PreviousKey(mk); !errors.Is(err, ErrNotReencrypting) {
		t.Fatalf("previous key after the end: %v", err)
	}
	for _, c := range []Credentials{pass("pw0"), c3, pass("pw5")} {
		got, _, err := h.Unlock(c, AnySlot)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.Bytes(), mk.Bytes()) {
			t.Fatal("a keyslot opens another key than the new one")
		}
		got.Wipe()
	}
	if err := FinishReencrypt(p, mk); !errors.Is(err, ErrNotReencrypting) {
		t.Fatalf("a second finish: %v", err)
	}
	// A second re-encryption moves to epoch 2.
	mk2, err := BeginReencrypt(p, mk, ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0")}, DropOthers: true})
	if err != nil {
		t.Fatal(err)
	}
	defer mk2.Wipe()
	h = mustRead(t, p)
	if r := h.Reencryption(); r.Epoch != 2 || !r.Active || h.ActiveSlots() != 1 {
		t.Fatalf("second re-encryption: %+v, %d slots", r, h.ActiveSlots())
	}
}

func TestBeginReencryptRefuses(t *testing.T) {
	t.Parallel()
	p, old, c3 := twoSlotVolume(t)
	good := p.bytesAt(0, HeaderSize)
	for _, tc := range []struct {
		name string
		o    ReencryptOptions
		want error
	}{
		{"slot 3 missing", ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0")}}, ErrSlotCredentials},
		{"wrong passphrase", ReencryptOptions{Slots: map[int]Credentials{0: pass("nope"), 3: c3}}, ErrWrongKey},
		{"wrong kind", ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0"), 3: pass("pw3")}}, ErrWrongKey},
		{"empty slot", ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0"), 3: c3, 4: pass("x")}}, ErrSlotEmpty},
		{"out of range", ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0"), 3: c3, 9: pass("x")}}, ErrSlotRange},
		{"nothing kept", ReencryptOptions{DropOthers: true}, ErrSlotCredentials},
		{"to aes-xts", ReencryptOptions{Mode: sector.ModeAESXTS256, Slots: map[int]Credentials{0: pass("pw0"), 3: c3}}, ErrModeChange},
	} {
		if _, err := BeginReencrypt(p, old, tc.o); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if !bytes.Equal(p.bytesAt(0, HeaderSize), good) {
			t.Fatalf("%s: the header changed", tc.name)
		}
	}
	// Dropping slot 3 explicitly works and empties it.
	mk, err := BeginReencrypt(p, old, ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0")}, DropOthers: true})
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	h := mustRead(t, p)
	if h.Slots[3].Active || !h.Slots[0].Active {
		t.Fatalf("slots after dropping 3: %+v", h.Slots)
	}
	if _, err := unlock(p, c3, AnySlot); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("dropped slot still unlocks: %v", err)
	}
}

func TestInPlace(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		from, to sector.Mode
		ok       bool
	}{
		{sector.ModeXChaCha20Poly1305, sector.ModeXChaCha20Poly1305, true},
		{sector.ModeAESXTS256, sector.ModeAESXTS256, true},
		{sector.ModeAESXTS128, sector.ModeAESXTS256, true},
		{sector.ModeNone, sector.ModeAESXTS256, true},
		{sector.ModeChaCha8XTS, sector.ModeAESXTS256, true},
		{sector.ModeXChaCha20Poly1305, sector.ModeAESXTS256, false},
		{sector.ModeAESXTS256, sector.ModeXChaCha20Poly1305, false},
		{sector.ModeInvalid, sector.ModeAESXTS256, false},
	} {
		err := InPlace(tc.from, tc.to)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrModeChange)) {
			t.Errorf("%s to %s: %v", tc.from, tc.to, err)
		}
	}
}

// A length-preserving volume changes mode: the header carries the new mode, the area
// the old one.
func TestReencryptModeChange(t *testing.T) {
	t.Parallel()
	p := newMem(testSize)
	l := Layout{Mode: sector.ModeAESXTS128, SectorSize: 4096, DataOffset: 65536, Sectors: 900}
	old, err := Create(p, l, pass("pw0"), tiny)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Wipe()
	mk, err := BeginReencrypt(p, old, ReencryptOptions{Mode: sector.ModeAESXTS256, Slots: map[int]Credentials{0: pass("pw0")}})
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	h := mustRead(t, p)
	if h.Mode != sector.ModeAESXTS256 || h.Reencryption().PrevMode != sector.ModeAESXTS128 {
		t.Fatalf("mode %s, previous %s", h.Mode, h.Reencryption().PrevMode)
	}
	// Finishing keeps the new mode.
	if err := FinishReencrypt(p, mk); err != nil {
		t.Fatal(err)
	}
	if h := mustRead(t, p); h.Mode != sector.ModeAESXTS256 {
		t.Fatalf("mode after the end: %s", h.Mode)
	}
}

// A crash at any write of BeginReencrypt, SetReencryptCursor or FinishReencrypt leaves a
// header that opens: the old state with the old key, or the new one with the new key (and
// the previous key in it while a re-encryption is under way).
func TestTornReencrypt(t *testing.T) {
	t.Parallel()
	base, old := newVolume(t)
	steps := []struct {
		name string
		run  func(p *crashProvider, mk *MasterKey) (*MasterKey, error)
	}{
		{"begin", func(p *crashProvider, mk *MasterKey) (*MasterKey, error) {
			return BeginReencrypt(p, mk, ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0")}})
		}},
		{"checkpoint", func(p *crashProvider, mk *MasterKey) (*MasterKey, error) {
			return mk, SetReencryptCursor(p, mk, 10)
		}},
		{"finish", func(p *crashProvider, mk *MasterKey) (*MasterKey, error) {
			return mk, FinishReencrypt(p, mk)
		}},
	}
	cur, curKey := base, old
	var prevKey *MasterKey
	for _, st := range steps {
		for writes := 0; ; writes++ {
			for _, torn := range []int{0, 100, 4000} {
				cp := &crashProvider{memProvider: cur.clone(), writes: writes, torn: torn}
				next, err := st.run(cp, curKey)
				if err == nil {
					continue
				}
				h := mustRead(t, cp.memProvider)
				got, _, err := h.Unlock(pass("pw0"), AnySlot)
				if err != nil {
					t.Fatalf("%s, crash after %d writes (torn %d): %v", st.name, writes, torn, err)
				}
				r := h.Reencryption()
				switch {
				case bytes.Equal(got.Bytes(), curKey.Bytes()):
				case next != nil && bytes.Equal(got.Bytes(), next.Bytes()):
				default:
					if st.name != "begin" {
						t.Fatalf("%s: unlocks a third key", st.name)
					}
					// Begin's new key is not returned on a crash: it must come with the
					// old one as the previous key.
					if !r.Active {
						t.Fatalf("begin: a new key without the re-encryption flag")
					}
				}
				if r.Active {
					pk, err := h.PreviousKey(got)
					if err != nil {
						t.Fatalf("%s, crash after %d writes: previous key: %v", st.name, writes, err)
					}
					want := old
					if prevKey != nil {
						want = prevKey
					}
					if !bytes.Equal(pk.Bytes(), want.Bytes()) {
						t.Fatalf("%s: the previous key is not the old master key", st.name)
					}
					pk.Wipe()
				}
				got.Wipe()
			}
			cp := &crashProvider{memProvider: cur.clone(), writes: writes}
			if next, err := st.run(cp, curKey); err == nil {
				if st.name == "begin" {
					prevKey = curKey
				}
				cur, curKey = cp.memProvider, next
				break
			}
		}
	}
	h := mustRead(t, cur)
	if r := h.Reencryption(); r.Active || r.Epoch != 1 {
		t.Fatalf("after the steps: %+v", r)
	}
}

// A backup made before a re-encryption, or during one that has finished since, holds a
// master key the data is no longer under: restore refuses it without --force.
func TestRestoreRefusesOldKeys(t *testing.T) {
	t.Parallel()
	p, old := newVolume(t)
	before := mustRead(t, p).Backup()
	mk, err := BeginReencrypt(p, old, ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0")}})
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	during := mustRead(t, p).Backup()
	if err := Restore(p, before, false); !errors.Is(err, ErrOldKeys) {
		t.Fatalf("restoring a backup of epoch 0 during epoch 1: %v", err)
	}
	// A backup of the same re-encryption under way is the current state.
	if err := Restore(p, during, false); err != nil {
		t.Fatal(err)
	}
	if err := FinishReencrypt(p, mk); err != nil {
		t.Fatal(err)
	}
	after := mustRead(t, p).Backup()
	for name, b := range map[string][]byte{"before": before, "during": during} {
		if err := Restore(p, b, false); !errors.Is(err, ErrOldKeys) {
			t.Fatalf("restoring the backup made %s the re-encryption: %v", name, err)
		}
	}
	if err := Restore(p, after, false); err != nil {
		t.Fatal(err)
	}
	if err := Restore(p, before, true); err != nil {
		t.Fatalf("--force: %v", err)
	}
	mustUnlock(t, p, pass("pw0"), 0, old)
}

func TestKillDropsPreviousKey(t *testing.T) {
	t.Parallel()
	p, _, _ := reencrypting(t)
	if err := Kill(p); err != nil {
		t.Fatal(err)
	}
	h := mustRead(t, p)
	if h.Reencryption().Active || !allZero(h.raw[offSlots:offReserved]) || !allZero(h.raw[offPrevMode:offAreaEnd]) {
		t.Fatal("kill left a keyslot or the previous key")
	}
}

// Every byte of the re-encryption area is checked: the fields by Decode or the sealed
// key's additional data, the nonce and the sealed key by its tag.
func TestReencryptAreaTamper(t *testing.T) {
	t.Parallel()
	p, _, mk := reencrypting(t)
	good := p.bytesAt(0, HeaderSize)
	q := p.clone()
	for off := offEpoch; off < offAreaEnd; off++ {
		raw := bytes.Clone(good)
		raw[off] ^= 0x01
		rewrite(q, 0, raw)
		rewrite(q, copyB(q), raw)
		h, err := Read(q)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("byte %d: %v", off, err)
			}
			continue
		}
		if err := h.Verify(mk); err != nil {
			continue // the epoch is under the MAC
		}
		if k, err := h.PreviousKey(mk); err == nil {
			k.Wipe()
			t.Fatalf("byte %d flipped: the previous key still opens", off)
		}
	}
}

// A re-encryption prepared in one process (the credentials' KDFs) and written by another
// (an attached volume's server): the bytes and the key cross over, the write checks them
// against the provider's header, and refuses a header written since, a start that
// changes more than a start does, and a previous key that is not the volume's.
func TestPreparedReencrypt(t *testing.T) {
	t.Parallel()
	p, old, c3 := twoSlotVolume(t)
	slots := ReencryptOptions{Slots: map[int]Credentials{0: pass("pw0"), 3: c3}}
	prepare := func() *PreparedReencrypt {
		t.Helper()
		pr, err := PrepareReencrypt(mustRead(t, p), old, slots)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pr.Wipe)
		return pr
	}
	good := p.bytesAt(0, HeaderSize)
	// Bytes and key as they cross a channel.
	cross := func(pr *PreparedReencrypt, edit func(raw []byte)) *PreparedReencrypt {
		t.Helper()
		raw := pr.Header()
		if edit != nil {
			edit(raw)
		}
		q, err := ParsePrepared(raw, pr.Key().Bytes())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(q.Wipe)
		return q
	}
	if _, err := ParsePrepared(prepare().Header(), old.Bytes()); !errors.Is(err, ErrHeaderTampered) && !errors.Is(err, ErrWrongKey) {
		t.Fatalf("a prepared header with the old key: %v", err)
	}
	if _, err := ParsePrepared(prepare().Header()[:100], old.Bytes()); err == nil {
		t.Fatal("a short prepared header parsed")
	}

	for _, tc := range []struct {
		name string
		edit func(raw []byte)
		want error
	}{
		{"a layout field", func(raw []byte) { raw[offSectors]++; fix(raw) }, ErrHeaderChanged},
		{"the volume ID", func(raw []byte) { raw[offVolumeID]++; fix(raw) }, ErrHeaderChanged},
		{"the reserved tail", func(raw []byte) { raw[offAreaEnd]++; fix(raw) }, ErrHeaderChanged},
	} {
		pr := prepare()
		raw := pr.Header()
		tc.edit(raw)
		var r [HeaderSize]byte
		copy(r[:], raw)
		q := &PreparedReencrypt{raw: r, next: pr.next}
		if err := CommitReencrypt(p, q); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if !bytes.Equal(p.bytesAt(0, HeaderSize), good) {
			t.Fatalf("%s: the header changed", tc.name)
		}
	}
	// A previous key that is not the volume's.
	{
		pr := prepare()
		other, err := generateMasterKey(rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		defer other.Wipe()
		r := pr.raw
		if err := sealPrevious(&r, pr.next, other, rand.Reader); err != nil {
			t.Fatal(err)
		}
		setChecksum(&r)
		if err := CommitReencrypt(p, &PreparedReencrypt{raw: r, next: pr.next}); !errors.Is(err, ErrHeaderTampered) {
			t.Fatalf("another previous key: %v", err)
		}
	}
	// A start at another epoch, MACed under the new key.
	{
		pr := prepare()
		r := pr.raw
		binary.LittleEndian.PutUint64(r[offEpoch:], 7)
		if err := sealPrevious(&r, pr.next, old, rand.Reader); err != nil {
			t.Fatal(err)
		}
		setMAC(&r, pr.next)
		setChecksum(&r)
		if err := CommitReencrypt(p, &PreparedReencrypt{raw: r, next: pr.next}); !errors.Is(err, ErrHeaderTampered) {
			t.Fatalf("a start at epoch 7: %v", err)
		}
	}
	if !bytes.Equal(p.bytesAt(0, HeaderSize), good) {
		t.Fatal("a refused start changed the header")
	}

	// Written since it was prepared: refused.
	stale := cross(prepare(), nil)
	if _, err := SetKey(p, old, 5, pass("pw5"), tiny); err != nil {
		t.Fatal(err)
	}
	if err := CommitReencrypt(p, stale); !errors.Is(err, ErrHeaderChanged) {
		t.Fatalf("a header written since: %v", err)
	}
	slots.Slots[5] = pass("pw5")
	pr := cross(prepare(), nil)
	if err := CommitReencrypt(p, pr); err != nil {
		t.Fatal(err)
	}
	h := mustRead(t, p)
	if r := h.Reencryption(); !r.Active || r.Epoch != 1 || r.Cursor != 0 {
		t.Fatalf("after the commit: %+v", r)
	}
	for i, c := range map[int]Credentials{0: pass("pw0"), 3: c3, 5: pass("pw5")} {
		mustUnlock(t, p, c, i, pr.Key())
	}
	if err := CommitReencrypt(p, pr); !errors.Is(err, ErrReencrypting) {
		t.Fatalf("a second commit: %v", err)
	}
}

// fix recomputes a header's checksum after an edit.
func fix(raw []byte) {
	var r [HeaderSize]byte
	copy(r[:], raw)
	setChecksum(&r)
	copy(raw, r[:])
}

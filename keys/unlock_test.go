package keys

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// Every byte of a header copy but the sequence number is protected: flipping any bit of
// it, with the checksum recomputed as an attacker would, makes the volume refuse to open
// with the credentials that byte concerns: the header's fields (slot AD and MAC), a slot's
// own fields (its AD and AEAD), reserved and empty-slot bytes (sanity checks). A slot's
// bytes concern only that slot: the other slot still opens.
func TestTamperedHeaderFailsUnlock(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	kf := Credentials{Keyfiles: [][]byte{[]byte("keyfile one"), []byte("keyfile two")}}
	if _, err := SetKey(p, mk, 5, kf, tiny); err != nil {
		t.Fatal(err)
	}
	good := p.bytesAt(0, HeaderSize)
	creds := []struct {
		slot int
		c    Credentials
	}{{0, pass("pw0")}, {5, kf}}

	// Which sentinel each field group may fail with, for the report below.
	group := func(off int) string {
		switch {
		case off < offSequence:
			return "magic/version/length"
		case off < offVolumeID:
			return "sequence"
		case off < offSectors:
			return "fields in slot AD"
		case off < offMAC:
			return "fields under MAC"
		case off < offSlots:
			return "MAC"
		case off < offReserved:
			return fmt.Sprintf("slot %d", (off-offSlots)/slotSize)
		}
		return "reserved"
	}
	kinds := map[string]map[string]int{}
	q := p.clone()
	for off := 0; off < offChecksum; off++ {
		for _, bit := range []byte{0x01, 0x80} {
			raw := append([]byte(nil), good...)
			raw[off] ^= bit
			rewrite(q, 0, raw)
			rewrite(q, copyB(q), raw)
			g := group(off)
			for _, c := range creds {
				_, err := unlock(q, c.c, AnySlot)
				affected := g != "sequence" && (!strings.HasPrefix(g, "slot ") || g == fmt.Sprintf("slot %d", c.slot) ||
					(g != "slot 0" && g != "slot 5")) // an empty slot's bytes must stay zero
				if affected && err == nil {
					t.Fatalf("byte %d (%s) bit %#x flipped: slot %d still opens", off, g, bit, c.slot)
				}
				// A flip in one slot may make the whole copy fail its sanity checks, but
				// never the other slot's cryptography.
				if !affected && err != nil && (g == "sequence" || !errors.Is(err, ErrCorrupt)) {
					t.Fatalf("byte %d (%s) bit %#x flipped: slot %d fails: %v", off, g, bit, c.slot, err)
				}
				if err != nil {
					k := "other"
					for _, s := range []error{ErrNotELI, ErrVersion, ErrCorrupt, ErrTooSmall, ErrWrongKey, ErrHeaderTampered} {
						if errors.Is(err, s) {
							k = s.Error()
							break
						}
					}
					if kinds[g] == nil {
						kinds[g] = map[string]int{}
					}
					kinds[g][k]++
				}
			}
		}
	}
	// The groups whose failure is a cryptographic check, not a sanity check, must fail it
	// the cryptographic way at least for the flips that pass the sanity checks.
	for g, want := range map[string]error{
		"fields under MAC":  ErrHeaderTampered,
		"MAC":               ErrHeaderTampered,
		"fields in slot AD": ErrWrongKey,
		"slot 0":            ErrWrongKey,
		"slot 5":            ErrWrongKey,
	} {
		if kinds[g][want.Error()] == 0 {
			t.Errorf("%s: no flip failed with %v (%v)", g, want, kinds[g])
		}
		if kinds[g]["other"] > 0 {
			t.Errorf("%s: failures with an unexpected error: %v", g, kinds[g])
		}
	}
	t.Logf("failures by field group: %v", kinds)
}

// The slot's KDF parameters are in its AD: lowering them (a downgrade) is a wrong key, not
// a weaker unlock.
func TestKDFDowngradeFails(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	if _, err := SetKey(p, mk, 1, pass("strong"), KDFParams{Time: 3, MemoryKiB: 512, Threads: 2}); err != nil {
		t.Fatal(err)
	}
	good := p.bytesAt(0, HeaderSize)
	for _, tc := range []struct {
		name string
		off  int
		val  byte
	}{
		{"passes", slotTime, 1},
		{"memory", slotMemory + 1, 1},
		{"threads", slotThreads, 1},
		{"credential flags", slotUses, byte(UsesPassphrase | UsesKeyfiles)},
	} {
		q := p.clone()
		raw := append([]byte(nil), good...)
		raw[offSlots+slotSize+tc.off] = tc.val
		rewrite(q, 0, raw)
		rewrite(q, copyB(q), raw)
		h := mustRead(t, q)
		if _, _, err := h.Unlock(pass("strong"), 1); !errors.Is(err, ErrWrongKey) {
			t.Errorf("%s lowered: Unlock = %v, want ErrWrongKey", tc.name, err)
		}
	}
}

func TestWrongCredentials(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	both := Credentials{Passphrase: []byte("pw"), Keyfiles: [][]byte{[]byte("kf")}}
	kfOnly := Credentials{Keyfiles: [][]byte{[]byte("kf2")}}
	if _, err := SetKey(p, mk, 3, both, tiny); err != nil {
		t.Fatal(err)
	}
	if _, err := SetKey(p, mk, 6, kfOnly, tiny); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		c    Credentials
		slot int
		kind error
		text string
	}{
		{"wrong passphrase", pass("pw1"), AnySlot, ErrWrongKey, "wrong passphrase or keyfile"},
		{"passphrase differs in case", pass("PW0"), AnySlot, ErrWrongKey, ""},
		{"passphrase with newline", pass("pw0\n"), AnySlot, ErrWrongKey, ""},
		{"wrong keyfile", Credentials{Passphrase: []byte("pw"), Keyfiles: [][]byte{[]byte("kF")}}, AnySlot, ErrWrongKey, ""},
		{"keyfile missing", pass("pw"), AnySlot, ErrWrongKey, ""},
		{"extra keyfile", Credentials{Passphrase: []byte("pw"), Keyfiles: [][]byte{[]byte("kf"), []byte("kf")}}, AnySlot, ErrWrongKey, ""},
		{"passphrase missing", Credentials{Keyfiles: [][]byte{[]byte("kf")}}, AnySlot, ErrWrongKey, ""},
		{"keyfile-only slot given a passphrase too", Credentials{Passphrase: []byte("x"), Keyfiles: kfOnly.Keyfiles}, AnySlot, ErrWrongKey, ""},
		{"right passphrase, wrong slot", pass("pw0"), 3, ErrWrongKey, "keyslot 3 takes passphrase+keyfiles, but passphrase was given"},
		{"nothing", Credentials{}, AnySlot, ErrNoCredentials, ""},
		{"empty passphrase", pass(""), AnySlot, ErrNoCredentials, ""},
		{"empty keyfile", Credentials{Keyfiles: [][]byte{{}}}, AnySlot, nil, "keyfile 1 is empty"},
		{"empty slot", pass("pw0"), 1, ErrSlotEmpty, "keyslot 1 is empty"},
		{"slot out of range", pass("pw0"), 8, ErrSlotRange, ""},
		{"negative slot", pass("pw0"), -2, ErrSlotRange, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := mustRead(t, p)
			got, slot, err := h.Unlock(tc.c, tc.slot)
			if err == nil {
				got.Wipe()
				t.Fatalf("Unlock opened slot %d", slot)
			}
			if got != nil || slot != -1 {
				t.Errorf("Unlock returned a key or slot with error %v", err)
			}
			if tc.kind != nil && !errors.Is(err, tc.kind) {
				t.Errorf("Unlock = %v, want %v", err, tc.kind)
			}
			if !strings.Contains(err.Error(), tc.text) {
				t.Errorf("Unlock = %q, want it to say %q", err, tc.text)
			}
		})
	}
	mustUnlock(t, p, both, 3, mk)
	mustUnlock(t, p, kfOnly, 6, mk)
}

// Each of the 8 keyslots works, alone and by number; a ninth key finds no free slot.
func TestEverySlot(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	for i := 1; i < NumSlots; i++ {
		slot, err := SetKey(p, mk, AnySlot, pass(fmt.Sprintf("pw%d", i)), tiny)
		if err != nil || slot != i {
			t.Fatalf("SetKey = %d, %v; want slot %d", slot, err, i)
		}
	}
	h := mustRead(t, p)
	if h.ActiveSlots() != NumSlots || h.Sequence != NumSlots {
		t.Errorf("%d active slots, sequence %d", h.ActiveSlots(), h.Sequence)
	}
	for i := range NumSlots {
		mustUnlock(t, p, pass(fmt.Sprintf("pw%d", i)), i, mk)
		got, slot, err := h.Unlock(pass(fmt.Sprintf("pw%d", i)), i)
		if err != nil || slot != i {
			t.Errorf("Unlock(slot %d) = %d, %v", i, slot, err)
		} else {
			got.Wipe()
		}
		if _, _, err := h.Unlock(pass(fmt.Sprintf("pw%d", i)), (i+1)%NumSlots); !errors.Is(err, ErrWrongKey) {
			t.Errorf("slot %d's passphrase on slot %d: %v", i, (i+1)%NumSlots, err)
		}
	}
	if _, err := SetKey(p, mk, AnySlot, pass("ninth"), tiny); !errors.Is(err, ErrNoFreeSlot) {
		t.Errorf("ninth SetKey = %v, want ErrNoFreeSlot", err)
	}
	// Replacing a slot by number: the old passphrase no longer opens it.
	if slot, err := SetKey(p, mk, 4, pass("replaced"), tiny); err != nil || slot != 4 {
		t.Fatalf("SetKey(4) = %d, %v", slot, err)
	}
	if _, err := unlock(p, pass("pw4"), AnySlot); !errors.Is(err, ErrWrongKey) {
		t.Errorf("old passphrase of a replaced slot: %v", err)
	}
	mustUnlock(t, p, pass("replaced"), 4, mk)
}

func TestKeyfileOrderDoesNotMatter(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	a, b, c := []byte("alpha"), []byte("bravo"), []byte("charlie")
	if _, err := SetKey(p, mk, 2, Credentials{Passphrase: []byte("pp"), Keyfiles: [][]byte{a, b, c}}, tiny); err != nil {
		t.Fatal(err)
	}
	for _, order := range [][][]byte{{a, b, c}, {c, b, a}, {b, c, a}, {c, a, b}} {
		mustUnlock(t, p, Credentials{Passphrase: []byte("pp"), Keyfiles: order}, 2, mk)
	}
	for _, wrong := range [][][]byte{{a, b}, {a, b, c, c}, {a, b, []byte("charliE")}} {
		if _, err := unlock(p, Credentials{Passphrase: []byte("pp"), Keyfiles: wrong}, AnySlot); !errors.Is(err, ErrWrongKey) {
			t.Errorf("keyfiles %q: %v, want ErrWrongKey", wrong, err)
		}
	}
}

func TestSetKeyNeedsThisVolumesKey(t *testing.T) {
	t.Parallel()
	p, _ := newVolume(t)
	_, other := newVolume(t)
	if _, err := SetKey(p, other, AnySlot, pass("x"), tiny); !errors.Is(err, ErrWrongKey) {
		t.Errorf("SetKey with another volume's key = %v, want ErrWrongKey", err)
	}
	forged, err := NewMasterKey(mustRead(t, p).VolumeID, make([]byte, MasterKeySize))
	if err != nil {
		t.Fatal(err)
	}
	defer forged.Wipe()
	if _, err := SetKey(p, forged, AnySlot, pass("x"), tiny); !errors.Is(err, ErrHeaderTampered) {
		t.Errorf("SetKey with a forged key = %v, want the MAC check to refuse it", err)
	}
	if mustRead(t, p).Sequence != 1 {
		t.Error("a refused SetKey wrote the header")
	}
}

// TestKeyslotReservedBytes: a keyslot's reserved bytes (12..15 and 152..191) must be zero:
// a header copy with one that is not is refused as corrupt, naming the keyslot, even with
// its checksum recomputed. The check is all that covers bytes 152..191: they lie outside
// the keyslot's additional data and the header MAC, where bytes 12..15 are inside the
// additional data (docs/format.md, "Keyslot").
func TestKeyslotReservedBytes(t *testing.T) {
	t.Parallel()
	p, _ := newVolume(t)
	good := p.bytesAt(0, HeaderSize)
	var raw [HeaderSize]byte
	copy(raw[:], good)
	ad, mac := slotAD(&raw, 0), authenticatedPrefix(&raw, offMAC)
	q := p.clone()
	for _, off := range []int{12, 15, 152, 170, 191} {
		changed := raw
		changed[offSlots+off] ^= 0x04
		if got := !bytes.Equal(slotAD(&changed, 0), ad); got != (off < slotSalt) {
			t.Errorf("keyslot byte %d in the keyslot's additional data: %v, want %v", off, got, off < slotSalt)
		}
		if !bytes.Equal(authenticatedPrefix(&changed, offMAC), mac) {
			t.Errorf("keyslot byte %d is under the header MAC", off)
		}
		rewrite(q, 0, changed[:])
		rewrite(q, copyB(q), changed[:])
		_, err := unlock(q, pass("pw0"), AnySlot)
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "keyslot 0: reserved bytes are not zero") {
			t.Errorf("keyslot byte %d not zero: %v, want a corrupt header naming keyslot 0's reserved bytes", off, err)
		}
	}
}

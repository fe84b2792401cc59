package keys

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/elidisk/eli/sector"
)

func slotAreaZero(p *memProvider, off int64, slot int) bool {
	return allZero(p.bytesAt(off+offSlots+int64(slot*slotSize), slotSize))
}

func TestDelKey(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	if _, err := SetKey(p, mk, 3, pass("pw3"), tiny); err != nil {
		t.Fatal(err)
	}
	if err := DelKey(p, 0, false); err != nil {
		t.Fatalf("DelKey(0): %v", err)
	}
	for _, off := range []int64{0, copyB(p)} {
		if !slotAreaZero(p, off, 0) {
			t.Errorf("slot 0 of the copy at %d is not zeroed", off)
		}
	}
	if _, err := unlock(p, pass("pw0"), AnySlot); !errors.Is(err, ErrWrongKey) {
		t.Errorf("deleted slot's passphrase: %v", err)
	}
	mustUnlock(t, p, pass("pw3"), 3, mk)

	for _, tc := range []struct {
		slot  int
		force bool
		kind  error
		text  string
	}{
		{0, false, ErrSlotEmpty, "keyslot 0 is empty"},
		{8, false, ErrSlotRange, "out of range"},
		{-1, true, ErrSlotRange, "out of range"},
		{3, false, ErrLastSlot, "refusing to delete keyslot 3, the last active keyslot"},
	} {
		if err := DelKey(p, tc.slot, tc.force); !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("DelKey(%d, %v) = %v, want %v saying %q", tc.slot, tc.force, err, tc.kind, tc.text)
		}
	}
	mustUnlock(t, p, pass("pw3"), 3, mk)
	if err := DelKey(p, 3, true); err != nil {
		t.Fatalf("forced DelKey of the last slot: %v", err)
	}
	h := mustRead(t, p)
	if _, _, err := h.Unlock(pass("pw3"), AnySlot); !errors.Is(err, ErrNoKeys) {
		t.Errorf("Unlock without slots = %v, want ErrNoKeys", err)
	}
}

func TestKill(t *testing.T) {
	t.Parallel()
	t.Run("valid header", func(t *testing.T) {
		t.Parallel()
		p, mk := newVolume(t)
		for _, s := range []int{2, 7} {
			if _, err := SetKey(p, mk, s, pass("x"), tiny); err != nil {
				t.Fatal(err)
			}
		}
		if err := Kill(p); err != nil {
			t.Fatalf("Kill: %v", err)
		}
		for _, off := range []int64{0, copyB(p)} {
			if !allZero(p.bytesAt(off+offSlots, offReserved-offSlots)) {
				t.Errorf("keyslot area of the copy at %d is not zero", off)
			}
		}
		h := mustRead(t, p)
		if h.ActiveSlots() != 0 || h.VolumeID != mk.VolumeID() || h.Warning != nil {
			t.Errorf("after kill: %d slots, warning %v", h.ActiveSlots(), h.Warning)
		}
		if _, _, err := h.Unlock(pass("pw0"), AnySlot); !errors.Is(err, ErrNoKeys) {
			t.Errorf("Unlock = %v, want ErrNoKeys", err)
		}
	})
	t.Run("both copies corrupt", func(t *testing.T) {
		t.Parallel()
		p, _ := newVolume(t)
		p.put(2000, []byte{1})
		p.put(copyB(p)+3000, []byte{1})
		if err := Kill(p); err != nil {
			t.Fatalf("Kill: %v", err)
		}
		for _, off := range []int64{0, copyB(p)} {
			if !allZero(p.bytesAt(off+offSlots, offReserved-offSlots)) {
				t.Errorf("keyslot area of the copy at %d is not zero", off)
			}
		}
	})
	t.Run("stale copy B after growth", func(t *testing.T) {
		t.Parallel()
		p, _ := newVolume(t)
		oldB := copyB(p)
		p.grow(testSize + 1<<20)
		if err := Kill(p); err != nil {
			t.Fatalf("Kill: %v", err)
		}
		if !allZero(p.bytesAt(oldB, HeaderSize)) {
			t.Error("the copy B left at the old end still holds the keyslots")
		}
	})
	t.Run("not eli", func(t *testing.T) {
		t.Parallel()
		p := newMem(testSize)
		p.put(1024, []byte("some filesystem"))
		before := p.clone()
		if err := Kill(p); !errors.Is(err, ErrNotELI) {
			t.Errorf("Kill = %v, want ErrNotELI", err)
		}
		if !bytes.Equal(p.b, before.b) {
			t.Error("Kill changed a provider without an eli header")
		}
	})
}

func TestBackupRestore(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	backup := mustRead(t, p).Backup()
	if !bytes.Equal(backup, p.bytesAt(0, HeaderSize)) || len(backup) != HeaderSize {
		t.Fatal("backup is not the header copy")
	}
	hb, err := Decode(backup)
	if err != nil || hb.VolumeID != mk.VolumeID() || hb.Copy != CopyNone {
		t.Fatalf("Decode(backup) = %v, %v", hb, err)
	}

	t.Run("both copies destroyed", func(t *testing.T) {
		t.Parallel()
		q := p.clone()
		q.put(0, make([]byte, HeaderSize))
		q.put(copyB(q)+50, []byte("junk"))
		if err := Restore(q, backup, false); err != nil {
			t.Fatalf("Restore: %v", err)
		}
		h := mustRead(t, q)
		if h.Warning != nil || h.Sequence != 2 {
			t.Errorf("after restore: warning %v sequence %d", h.Warning, h.Sequence)
		}
		mustUnlock(t, q, pass("pw0"), 0, mk)
	})
	t.Run("undoes a later delkey, and wins over it", func(t *testing.T) {
		t.Parallel()
		q := p.clone()
		if _, err := SetKey(q, mk, 1, pass("pw1"), tiny); err != nil {
			t.Fatal(err)
		}
		if err := DelKey(q, 0, false); err != nil {
			t.Fatal(err)
		}
		if err := Restore(q, backup, false); err != nil {
			t.Fatalf("Restore: %v", err)
		}
		h := mustRead(t, q)
		if h.Sequence != 4 {
			t.Errorf("restored sequence %d, want 4 (above the current 3)", h.Sequence)
		}
		mustUnlock(t, q, pass("pw0"), 0, mk)
		if _, err := unlock(q, pass("pw1"), AnySlot); err == nil {
			t.Error("slot 1, added after the backup, still opens")
		}
	})
	t.Run("another volume", func(t *testing.T) {
		t.Parallel()
		other, _ := newVolume(t)
		err := Restore(other, backup, false)
		if !errors.Is(err, ErrOtherVolume) || !strings.Contains(err.Error(), "belongs to volume") {
			t.Fatalf("Restore = %v, want ErrOtherVolume", err)
		}
		if _, err := unlock(other, pass("pw0"), AnySlot); err != nil {
			t.Fatalf("a refused restore broke the volume: %v", err)
		}
		if err := Restore(other, backup, true); err != nil {
			t.Fatalf("forced Restore: %v", err)
		}
		mustUnlock(t, other, pass("pw0"), 0, mk)
	})
	t.Run("provider too small", func(t *testing.T) {
		t.Parallel()
		small := newMem(1 << 20)
		for _, force := range []bool{false, true} {
			if err := Restore(small, backup, force); !errors.Is(err, ErrTooSmall) {
				t.Errorf("Restore(force %v) = %v, want ErrTooSmall", force, err)
			}
		}
		if !allZero(small.b) {
			t.Error("a refused restore wrote to the provider")
		}
	})
	t.Run("provider of another size", func(t *testing.T) {
		t.Parallel()
		q := p.clone()
		q.grow(testSize + 1<<20)
		if err := Restore(q, backup, false); !errors.Is(err, ErrSizeMismatch) {
			t.Errorf("Restore = %v, want ErrSizeMismatch", err)
		}
		if err := Restore(q, backup, true); err != nil {
			t.Fatalf("forced Restore: %v", err)
		}
		mustUnlock(t, q, pass("pw0"), 0, mk)
	})
	t.Run("bad backups", func(t *testing.T) {
		t.Parallel()
		flipped := bytes.Clone(backup)
		flipped[200] ^= 1
		v2 := bytes.Clone(backup)
		binary.LittleEndian.PutUint32(v2[offVersion:], 3)
		for _, tc := range []struct {
			name string
			b    []byte
			kind error
		}{
			{"flipped bit", flipped, ErrCorrupt},
			{"truncated", backup[:HeaderSize-1], ErrCorrupt},
			{"too long", append(bytes.Clone(backup), 0), ErrCorrupt},
			{"version 3", v2, ErrVersion},
			{"not a header", make([]byte, HeaderSize), ErrNotELI},
		} {
			q := p.clone()
			if err := Restore(q, tc.b, true); !errors.Is(err, tc.kind) {
				t.Errorf("%s: Restore = %v, want %v", tc.name, err, tc.kind)
			}
			if !bytes.Equal(q.b, p.b) {
				t.Errorf("%s: a refused restore wrote to the provider", tc.name)
			}
		}
	})
}

func TestResize(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	oldB := copyB(p)
	p.grow(8 << 20)
	if err := Resize(p, mk, 400); !errors.Is(err, ErrLayout) {
		t.Errorf("shrinking Resize = %v, want ErrLayout", err)
	}
	if err := Resize(p, mk, 1<<20); !errors.Is(err, ErrTooSmall) {
		t.Errorf("oversized Resize = %v, want ErrTooSmall", err)
	}
	_, other := newVolume(t)
	if err := Resize(p, other, 1000); !errors.Is(err, ErrWrongKey) {
		t.Errorf("Resize with another volume's key = %v, want ErrWrongKey", err)
	}
	if err := Resize(p, mk, 1500); err != nil {
		t.Fatalf("Resize: %v", err)
	}
	h := mustRead(t, p)
	if h.Sectors != 1500 || h.ProviderSize != 8<<20 || h.Warning != nil || h.Sequence != 2 {
		t.Errorf("after resize: N %d, size %d, warning %v, sequence %d", h.Sectors, h.ProviderSize, h.Warning, h.Sequence)
	}
	if !allZero(p.bytesAt(oldB, HeaderSize)) {
		t.Error("the old copy B was left in the grown data area")
	}
	mustUnlock(t, p, pass("pw0"), 0, mk)

	// A header whose N was raised without the key fails the MAC.
	raw := p.bytesAt(0, HeaderSize)
	binary.LittleEndian.PutUint64(raw[offSectors:], 1600)
	rewrite(p, 0, raw)
	rewrite(p, copyB(p), raw)
	if _, err := unlock(p, pass("pw0"), AnySlot); !errors.Is(err, ErrHeaderTampered) {
		t.Errorf("unlock after N was changed without the key: %v, want ErrHeaderTampered", err)
	}
}

// A crash at any write of a resize leaves a header that opens, with the old or the new N.
func TestTornResize(t *testing.T) {
	t.Parallel()
	for writes := range 4 {
		for _, torn := range []int{0, 2048} {
			base, mk := newVolume(t)
			base.grow(8 << 20)
			c := &crashProvider{memProvider: base, writes: writes, torn: torn}
			err := Resize(c, mk, 1500)
			if writes < 3 && !errors.Is(err, errCrashed) {
				t.Fatalf("writes %d: Resize = %v, want the crash", writes, err)
			}
			h := mustRead(t, base)
			if h.Sectors != 500 && h.Sectors != 1500 {
				t.Errorf("writes %d torn %d: N = %d", writes, torn, h.Sectors)
			}
			if writes >= 2 && h.Sectors != 1500 {
				t.Errorf("writes %d torn %d: copy B at the new end was synced, but N = %d", writes, torn, h.Sectors)
			}
			mustUnlock(t, base, pass("pw0"), 0, mk)
		}
	}
}

func TestCreateRefuses(t *testing.T) {
	t.Parallel()
	good := testLayout()
	with := func(f func(l *Layout)) Layout { l := good; f(&l); return l }
	cases := []struct {
		name string
		size int64
		l    Layout
		c    Credentials
		kdf  KDFParams
		kind error
	}{
		{"too small", 1 << 20, good, pass("x"), tiny, ErrTooSmall},
		{"one sector too many", testSize, with(func(l *Layout) { l.Sectors = 967 }), pass("x"), tiny, ErrTooSmall},
		{"tiny provider", 65536, with(func(l *Layout) { l.Sectors = 1 }), pass("x"), tiny, ErrTooSmall},
		{"bad mode", testSize, with(func(l *Layout) { l.Mode = 0 }), pass("x"), tiny, ErrLayout},
		{"bad sector size", testSize, with(func(l *Layout) { l.SectorSize = 3000 }), pass("x"), tiny, ErrLayout},
		{"no journal", testSize, with(func(l *Layout) { l.JournalLen = 0; l.DataOffset = 65536 }), pass("x"), tiny, ErrLayout},
		{"journal for xts", testSize, with(func(l *Layout) { l.Mode = sector.ModeAESXTS256 }), pass("x"), tiny, ErrLayout},
		{"unaligned journal", testSize, with(func(l *Layout) { l.JournalLen = 4096 }), pass("x"), tiny, ErrLayout},
		{"data over journal", testSize, with(func(l *Layout) { l.DataOffset = 65536 }), pass("x"), tiny, ErrLayout},
		{"unaligned data", testSize, with(func(l *Layout) { l.DataOffset = 135168 }), pass("x"), tiny, ErrLayout},
		{"no sectors", testSize, with(func(l *Layout) { l.Sectors = 0 }), pass("x"), tiny, ErrLayout},
		{"overflow", testSize, with(func(l *Layout) { l.Sectors = 1 << 62 }), pass("x"), tiny, ErrLayout},
		{"no credentials", testSize, good, Credentials{}, tiny, ErrNoCredentials},
		{"zero KDF", testSize, good, pass("x"), KDFParams{}, ErrKDFParams},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newMem(tc.size)
			mk, err := Create(p, tc.l, tc.c, tc.kdf)
			if !errors.Is(err, tc.kind) {
				t.Errorf("Create = %v, want %v", err, tc.kind)
			}
			if mk != nil {
				mk.Wipe()
				t.Error("Create returned a key with an error")
			}
			if !allZero(p.b) {
				t.Error("a refused Create wrote to the provider")
			}
		})
	}
	// The largest N that fits is accepted: the limit is exact. For 4 MiB, E = 4128768;
	// from D = 131072 that is 9 groups of 421888 bytes (918 sectors) plus a last group of
	// 200704 bytes: one 4096-byte metadata block and 48 sectors, so 966.
	p := newMem(testSize)
	mk, err := Create(p, with(func(l *Layout) { l.Sectors = 966 }), pass("x"), tiny)
	if err != nil {
		t.Fatalf("Create with the largest N: %v", err)
	}
	mk.Wipe()
}

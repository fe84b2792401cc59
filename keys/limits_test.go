package keys

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"
)

// hostile returns a copy of p whose keyslot i asks for the given Argon2id parameters, with
// the checksums fixed as an attacker would: the header decodes, the slot cannot open.
func hostile(t *testing.T, p *memProvider, i int, kdf KDFParams) *memProvider {
	t.Helper()
	q := p.clone()
	raw := q.bytesAt(0, HeaderSize)
	s := raw[offSlots+i*slotSize:]
	s[slotThreads] = kdf.Threads
	binary.LittleEndian.PutUint32(s[slotTime:], kdf.Time)
	binary.LittleEndian.PutUint32(s[slotMemory:], kdf.MemoryKiB)
	rewrite(q, 0, raw)
	rewrite(q, copyB(q), raw)
	return q
}

// The format's largest parameters in all eight keyslots: under the default limits Unlock
// refuses without deriving anything (one derivation would take hours), and names the
// limit. The test finishing at all is the proof that nothing was derived.
func TestHostileKDFRefused(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	for i := 1; i < NumSlots; i++ {
		if _, err := SetKey(p, mk, i, pass("pw0"), tiny); err != nil {
			t.Fatal(err)
		}
	}
	worst := KDFParams{Time: MaxKDFTime, MemoryKiB: MaxKDFMemoryKiB, Threads: 255}
	q := p
	for i := range NumSlots {
		q = hostile(t, q, i, worst)
	}
	h := mustRead(t, q)
	for _, slot := range []int{AnySlot, 0, 7} {
		_, _, err := h.Unlock(pass("pw0"), slot)
		if !errors.Is(err, ErrKDFLimit) {
			t.Fatalf("slot %d: Unlock = %v, want ErrKDFLimit", slot, err)
		}
		if !strings.Contains(err.Error(), "limit of") {
			t.Errorf("slot %d: the error does not name the limit: %v", slot, err)
		}
	}
}

// The work limit is one budget for the whole unlock, spent in slot order: a slot whose
// work exceeds what is left is skipped, a cheaper one after it is still tried, and naming
// the slot spends the budget on that slot alone.
func TestKDFWorkBudget(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t) // slot 0: "pw0", tiny
	big := KDFParams{Time: 4, MemoryKiB: 64, Threads: 1}
	if _, err := SetKey(p, mk, 1, pass("pw1"), big); err != nil {
		t.Fatal(err)
	}
	if _, err := SetKey(p, mk, 2, pass("pw2"), tiny); err != nil {
		t.Fatal(err)
	}
	h := mustRead(t, p)
	// Room for slot 0 and slot 2, not for slot 1 after slot 0; room for slot 1 alone.
	lim := KDFLimits{MemoryKiB: 1 << 20, Threads: 4, WorkKiB: 2 * tiny.work()}
	one := KDFLimits{MemoryKiB: 1 << 20, Threads: 4, WorkKiB: big.work()}
	for _, tc := range []struct {
		name     string
		pass     string
		slot     int
		lim      KDFLimits
		wantSlot int
		wantErr  error
		inErr    string
	}{
		{"first slot", "pw0", AnySlot, lim, 0, nil, ""},
		{"skips the slot past the budget, tries the next", "pw2", AnySlot, lim, 2, nil, ""},
		{"the skipped slot is reported", "pw1", AnySlot, lim, -1, ErrKDFLimit, "keyslot 1: Argon2id work 64 KiB × 4 passes is more than the limit of 128 KiB × passes"},
		{"naming the slot spends the budget on it", "pw1", 1, one, 1, nil, ""},
		{"slot 1 alone is within the limit, after slot 0 it is not", "pw1", AnySlot, one, -1, ErrKDFLimit, "keyslot 1: its Argon2id work 64 KiB × 4 passes is more than is left (192 KiB × passes)"},
		{"memory limit", "pw0", AnySlot, KDFLimits{MemoryKiB: 32, Threads: 4, WorkKiB: 1 << 30}, -1, ErrKDFLimit, "Argon2id memory 64 KiB is more than the limit of 32 KiB"},
		{"lanes limit", "pw0", 0, KDFLimits{MemoryKiB: 1 << 20, Threads: 0, WorkKiB: 1 << 30}, -1, ErrKDFLimit, "more than the limit of 0 lanes"},
		{"no limits", "pw1", AnySlot, NoKDFLimits, 1, nil, ""},
		{"wrong key within the limits", "nope", AnySlot, NoKDFLimits, -1, ErrWrongKey, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, i, err := h.UnlockWithin(pass(tc.pass), tc.slot, tc.lim)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.inErr) {
					t.Fatalf("UnlockWithin = %v, want %v containing %q", err, tc.wantErr, tc.inErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("UnlockWithin: %v", err)
			}
			got.Wipe()
			if i != tc.wantSlot {
				t.Fatalf("opened slot %d, want %d", i, tc.wantSlot)
			}
		})
	}
}

func TestDefaultKDFLimits(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		total uint64
		want  uint64 // KiB
	}{
		{0, MaxKDFMemoryKiB},
		{2 << 30, 1 << 20},
		{64 << 30, MaxKDFMemoryKiB},
	} {
		l := defaultLimits(tc.total)
		if l.MemoryKiB != tc.want || l.Threads != LimitKDFThreads || l.WorkKiB != LimitKDFWorkKiB {
			t.Errorf("defaultLimits(%d) = %+v, want memory %d KiB", tc.total, l, tc.want)
		}
	}
	// What eli creates by default must open under the default limits on the same machine.
	p, err := Fixed(1, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	p.Time = LimitKDFWorkKiB / p.MemoryKiB
	if err := DefaultKDFLimits().Check(p); err != nil {
		t.Errorf("default memory at %d passes: %v", p.Time, err)
	}
}

package keys

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

func testLayoutV2(t testing.TB) Layout {
	t.Helper()
	l, err := layout.PlanVersion(layout.Version2, testSize, 4096, sector.ModeXChaCha20Poly1305, 65536)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestVersion2 creates a format version 2 header and reads it back; version 1 headers
// keep reading as version 1 (TestCreateReadRoundTrip, TestGoldenHeader).
func TestVersion2(t *testing.T) {
	t.Parallel()
	l := testLayoutV2(t)
	p := newMem(testSize)
	mk, err := Create(p, l, pass("pw"), tiny)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	h := mustRead(t, p)
	if h.Version != 2 || h.Layout != l || !h.Layout.Tree() {
		t.Fatalf("read version %d layout %+v, want 2 and %+v", h.Version, h.Layout, l)
	}
	if !strings.Contains(h.Dump(), "version:        2\n") {
		t.Errorf("dump does not say version 2:\n%s", h.Dump())
	}
	mustUnlock(t, p, pass("pw"), 0, mk)
	// Growing keeps the version (the tree's shape does not depend on the size).
	p.grow(2 * testSize)
	if err := Resize(p, mk, l.Sectors+100); err != nil {
		t.Fatalf("Resize of a version 2 volume: %v", err)
	}
	if h := mustRead(t, p); h.Version != 2 || !h.Layout.Tree() || h.Sectors != l.Sectors+100 {
		t.Errorf("after Resize: version %d, %d sectors", h.Version, h.Sectors)
	}
}

// TestVersionDowngrade: a version 2 header rewritten as version 1 (checksum fixed, as
// anyone can) would shed the hash tree; every keyslot's AD (and the MAC) covers the
// version, so Unlock refuses it.
// The reverse too.
func TestVersionDowngrade(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		l        Layout
		from, to uint32
	}{
		{"2 to 1", testLayoutV2(t), 2, 1},
		{"1 to 2", testLayout(), 1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newMem(testSize)
			mk, err := Create(p, tc.l, pass("pw"), tiny)
			if err != nil {
				t.Fatal(err)
			}
			mk.Wipe()
			for _, off := range []int64{0, copyB(p)} {
				raw := p.bytesAt(off, HeaderSize)
				if v := binary.LittleEndian.Uint32(raw[offVersion:]); v != tc.from {
					t.Fatalf("version field %d, want %d", v, tc.from)
				}
				binary.LittleEndian.PutUint32(raw[offVersion:], tc.to)
				rewrite(p, off, raw)
			}
			h := mustRead(t, p)
			if h.Version != tc.to {
				t.Fatalf("read version %d, want %d", h.Version, tc.to)
			}
			if _, _, err := h.Unlock(pass("pw"), AnySlot); !errors.Is(err, ErrWrongKey) && !errors.Is(err, ErrHeaderTampered) {
				t.Errorf("Unlock of a header whose version was changed: %v, want a refusal", err)
			}
		})
	}
}

func TestVersion2LengthPreserving(t *testing.T) {
	t.Parallel()
	l := Layout{Version: layout.Version2, Mode: sector.ModeAESXTS256, SectorSize: 4096, DataOffset: 65536, Sectors: 100}
	if _, err := Create(newMem(testSize), l, pass("pw"), tiny); err == nil {
		t.Fatal("Create made a version 2 header for a length-preserving mode")
	}
	// Forged on disk (checksum fixed): Decode refuses it as corrupt.
	p, mk := newVolume(t)
	_ = mk
	raw := p.bytesAt(0, HeaderSize)
	raw[offMode] = byte(sector.ModeAESXTS256)
	binary.LittleEndian.PutUint32(raw[offVersion:], 2)
	binary.LittleEndian.PutUint64(raw[offJournalOff:], 0)
	binary.LittleEndian.PutUint64(raw[offJournalLen:], 0)
	binary.LittleEndian.PutUint64(raw[offDataOffset:], 65536)
	rewrite(p, 0, raw)
	if _, err := Decode(p.bytesAt(0, HeaderSize)); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Decode of a version 2 length-preserving header: %v, want ErrCorrupt", err)
	}
}

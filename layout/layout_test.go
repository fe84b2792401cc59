package layout

import (
	"testing"

	"github.com/elidisk/eli/sector"
)

func TestPlanLayout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		size       int64
		sectorSize int
		mode       sector.Mode
		journal    int64
		wantErr    bool
	}{
		{1 << 30, 4096, sector.ModeXChaCha20Poly1305, 0, false},
		{1 << 30, 512, sector.ModeXChaCha20Poly1305, 1 << 20, false},
		{1<<30 + 12345, 65536, sector.ModeXChaCha20Poly1305, 0, false},
		{1 << 40, 4096, sector.ModeXChaCha20Poly1305, 0, false},
		{1 << 30, 4096, sector.ModeAESXTS256, 0, false},
		{1<<20 + 777, 512, sector.ModeNone, 0, false},
		{100000, 4096, sector.ModeXChaCha20Poly1305, 0, true},
		{1 << 30, 4096, sector.ModeXChaCha20Poly1305, 12345, true},
		{1 << 30, 3000, sector.ModeXChaCha20Poly1305, 0, true},
	} {
		l, err := Plan(tc.size, tc.sectorSize, tc.mode, tc.journal)
		if tc.wantErr {
			if err == nil {
				t.Errorf("%+v: planned %+v, want an error", tc, l)
			}
			continue
		}
		if err != nil {
			t.Errorf("%+v: %v", tc, err)
			continue
		}
		// Maximal: one more sector does not fit.
		more := l
		more.Sectors++
		if more.Validate(tc.size) == nil {
			t.Errorf("%+v: %d sectors planned but %d fit", tc, l.Sectors, more.Sectors)
		}
		end := l.DataOffset + l.Span()
		if end > DataLimit(tc.size) || DataLimit(tc.size)%Align != 0 || end > HeaderBOffset(tc.size) {
			t.Errorf("%+v: data area ends at %d, past E=%d", tc, end, DataLimit(tc.size))
		}
	}
	// The minimum size is exactly the smallest that works.
	probe, _ := Plan(1<<30, 4096, sector.ModeXChaCha20Poly1305, 0)
	min := MinProviderSize(probe)
	if l, err := Plan(min, 4096, sector.ModeXChaCha20Poly1305, 0); err != nil || l.Sectors < 1 {
		t.Errorf("at the minimum size %d: %+v, %v", min, l, err)
	}
	if _, err := Plan(min-4096, 4096, sector.ModeXChaCha20Poly1305, 0); err == nil {
		t.Errorf("below the minimum size %d: no error", min)
	}
}

func TestGeometry(t *testing.T) {
	t.Parallel()
	// docs/format.md: M = max(S, 4096), R = floor(M/40), G = M + R·S.
	for _, tc := range []struct{ s, m, r int }{{512, 4096, 102}, {4096, 4096, 102}, {65536, 65536, 1638}} {
		l := Layout{Mode: sector.ModeXChaCha20Poly1305, SectorSize: tc.s, DataOffset: 1 << 20, Sectors: 1000}
		if l.MetaBlockSize() != tc.m || l.RecordsPerGroup() != tc.r || l.GroupLen() != int64(tc.m+tc.r*tc.s) {
			t.Errorf("S=%d: M=%d R=%d G=%d", tc.s, l.MetaBlockSize(), l.RecordsPerGroup(), l.GroupLen())
		}
		// Sector R+1 is the second sector of group 1.
		if got, want := l.DataPos(uint64(tc.r+1)), int64(1<<20)+l.GroupLen()+int64(tc.m)+int64(tc.s); got != want {
			t.Errorf("S=%d: dataPos(R+1)=%d want %d", tc.s, got, want)
		}
		if got := l.Span(); got != int64(1000/tc.r)*l.GroupLen()+func() int64 {
			if rem := 1000 % tc.r; rem > 0 {
				return int64(tc.m + rem*tc.s)
			}
			return 0
		}() {
			t.Errorf("S=%d: span %d", tc.s, got)
		}
	}
}

func TestDataSpan(t *testing.T) {
	t.Parallel()
	aead := sector.ModeXChaCha20Poly1305
	for _, tc := range []struct {
		m    sector.Mode
		s    int
		n    uint64
		want int64
	}{
		{sector.ModeAESXTS256, 4096, 10, 40960},
		{aead, 4096, 1, 4096 + 4096},
		{aead, 4096, 102, 4096 + 102*4096},
		{aead, 4096, 103, 4096 + 102*4096 + 4096 + 4096},
		{aead, 512, 102, 4096 + 102*512},
		{aead, 65536, 1638, 65536 + 1638*65536},
		{aead, 65536, 1639, 65536 + 1638*65536 + 65536 + 65536},
	} {
		if got, ok := (Layout{Mode: tc.m, SectorSize: tc.s, Sectors: tc.n}).span(); !ok || got != tc.want {
			t.Errorf("span(%v, %d, %d) = %d, %v; want %d", tc.m, tc.s, tc.n, got, ok, tc.want)
		}
	}
	if _, ok := (Layout{Mode: aead, SectorSize: 65536, Sectors: ^uint64(0)}).span(); ok {
		t.Error("span of 2^64-1 sectors did not overflow")
	}
}

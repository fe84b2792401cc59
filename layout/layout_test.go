package layout

import (
	"cmp"
	"slices"
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

// TestTreeLayout checks version 2's nested placement: every tree node of the minimal tree
// over the groups and every group lie in the data area, in order, without overlapping, and
// a group's position does not depend on the volume's size (resize moves nothing).
func TestTreeLayout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		sectorSize int
		sectors    uint64
	}{
		{4096, 1},
		{4096, 102*128 + 5},
		{512, 102 * 128 * 128 * 2},
		{65536, 1638*3 + 1},
	} {
		l := Layout{Version: Version2, Mode: sector.ModeXChaCha20Poly1305, SectorSize: tc.sectorSize,
			JournalLen: DefaultJournalLen, DataOffset: HeaderRegionLen + DefaultJournalLen, Sectors: tc.sectors}
		if err := l.Check(); err != nil {
			t.Fatalf("%+v: %v", tc, err)
		}
		type extent struct {
			what     string
			off, len int64
		}
		var ext []extent
		groups := l.Groups()
		width := groups
		for level := 1; level <= TreeDepth; level++ {
			width = (width + TreeArity - 1) / TreeArity
			for k := range width {
				ext = append(ext, extent{"node", l.NodePos(level, k), NodeSize})
			}
		}
		for g := range groups {
			ext = append(ext, extent{"group", l.BlockPos(g), int64(l.MetaBlockSize()) + int64(l.GroupSectors(g))*int64(l.SectorSize)})
		}
		slices.SortFunc(ext, func(a, b extent) int { return cmp.Compare(a.off, b.off) })
		if ext[0].off != l.DataOffset {
			t.Errorf("%+v: first extent at %d, data area at %d", tc, ext[0].off, l.DataOffset)
		}
		for i := 1; i < len(ext); i++ {
			if ext[i].off < ext[i-1].off+ext[i-1].len {
				t.Fatalf("%+v: %s at %d overlaps %s at %d+%d", tc, ext[i].what, ext[i].off, ext[i-1].what, ext[i-1].off, ext[i-1].len)
			}
		}
		last := ext[len(ext)-1]
		if end := last.off + last.len; end != l.End() {
			t.Errorf("%+v: last extent ends at %d, End is %d", tc, end, l.End())
		}
		// Sector data positions follow the group's block.
		i := tc.sectors - 1
		g, j := l.GroupOf(i)
		if l.DataPos(i) != l.BlockPos(g)+int64(l.MetaBlockSize())+int64(j)*int64(l.SectorSize) {
			t.Errorf("%+v: DataPos(%d) = %d", tc, i, l.DataPos(i))
		}
		// Growing the volume moves nothing.
		grown := l
		grown.Sectors *= 1000
		for g := range groups {
			if grown.BlockPos(g) != l.BlockPos(g) {
				t.Fatalf("%+v: group %d moves from %d to %d when the volume grows", tc, g, l.BlockPos(g), grown.BlockPos(g))
			}
		}
	}
}

func TestTreeLayoutFixed(t *testing.T) {
	t.Parallel()
	// 4096-byte sectors: M = 4096, R = 102, G = 4096 + 102·4096 = 421888.
	l := Layout{Version: Version2, Mode: sector.ModeXChaCha20Poly1305, SectorSize: 4096,
		JournalLen: 1 << 20, DataOffset: HeaderRegionLen + 1<<20, Sectors: 1 << 30}
	d := l.DataOffset
	const g = 421888
	u1 := int64(NodeSize + 128*g)
	u2 := int64(NodeSize) + 128*u1
	for _, tc := range []struct {
		got, want int64
		what      string
	}{
		{l.NodePos(7, 0), d, "level 7 node 0"},
		{l.NodePos(1, 0), d + 6*NodeSize, "level 1 node 0"},
		{l.BlockPos(0), d + 7*NodeSize, "group 0"},
		{l.BlockPos(1), d + 7*NodeSize + g, "group 1"},
		{l.NodePos(1, 1), d + 6*NodeSize + u1, "level 1 node 1"},
		{l.BlockPos(128), d + 7*NodeSize + u1, "group 128"},
		{l.NodePos(2, 1), d + 5*NodeSize + u2, "level 2 node 1"},
		{l.BlockPos(128*128 + 129), d + 7*NodeSize + u2 + u1 + g, "group 16513"},
	} {
		if tc.got != tc.want {
			t.Errorf("%s at %d, want %d", tc.what, tc.got, tc.want)
		}
	}
}

func TestVersionCheck(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		version uint32
		mode    sector.Mode
		ok      bool
	}{
		{0, sector.ModeXChaCha20Poly1305, true},
		{1, sector.ModeAESXTS256, true},
		{2, sector.ModeXChaCha20Poly1305, true},
		{2, sector.ModeAESXTS256, false},
		{3, sector.ModeXChaCha20Poly1305, false},
	} {
		l, err := PlanVersion(tc.version, 1<<30, 4096, tc.mode, 0)
		if (err == nil) != tc.ok {
			t.Errorf("version %d %s: planned %+v, err %v", tc.version, tc.mode, l, err)
		}
	}
}

func TestPlanVersion2(t *testing.T) {
	t.Parallel()
	for _, size := range []int64{1 << 24, 1<<30 + 12345, 1 << 40, 1 << 44} {
		for _, s := range []int{512, 4096, 65536} {
			l, err := PlanVersion(Version2, size, s, sector.ModeXChaCha20Poly1305, 0)
			if err != nil {
				t.Fatalf("%d/%d: %v", size, s, err)
			}
			more := l
			more.Sectors++
			if more.Validate(size) == nil {
				t.Errorf("%d/%d: %d sectors planned but %d fit", size, s, l.Sectors, more.Sectors)
			}
			v1, _ := Plan(size, s, sector.ModeXChaCha20Poly1305, 0)
			// The nodes take about 1/128 of the metadata blocks' room.
			if l.Sectors > v1.Sectors || v1.Sectors-l.Sectors > v1.Sectors/1000+uint64(TreeDepth*NodeSize/s)+2 {
				t.Errorf("%d/%d: version 2 holds %d sectors, version 1 %d", size, s, l.Sectors, v1.Sectors)
			}
		}
	}
}

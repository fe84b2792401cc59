package blockdev

import (
	"fmt"
	"testing"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

// TestGeometryMatchesLayout: the cached geometry gives the same positions as
// layout.Layout, for every kind of layout, at group edges and at the last sector.
func TestGeometryMatchesLayout(t *testing.T) {
	t.Parallel()
	for _, mode := range []sector.Mode{sector.ModeXChaCha20Poly1305, sector.ModeNone, sector.ModeAESXTS256} {
		for _, ss := range []int{512, 4096, 65536} {
			for _, vs := range []struct {
				version uint32
				size    int64
			}{{0, 8 << 20}, {0, 300 << 20}, {2, 8 << 20}, {2, 300 << 20}, {2, 1 << 50}} {
				version, size := vs.version, vs.size
				if version == 2 && !mode.Authenticated() {
					continue
				}
				l, err := layout.PlanVersion(version, size, ss, mode, 0)
				if err != nil {
					continue // too small for this sector size
				}
				t.Run(fmt.Sprintf("%s/%d/%d/v%d", mode, ss, size, version), func(t *testing.T) {
					t.Parallel()
					g := newGeometry(l)
					if g.auth != l.Authenticated() {
						t.Fatalf("auth %v, layout %v", g.auth, l.Authenticated())
					}
					r := uint64(max(1, l.RecordsPerGroup()))
					var idx []uint64
					for _, i := range []uint64{0, 1, r - 1, r, r + 1, 2*r - 1, 5 * r, 128*r - 1, 128 * r, 128*128*r + r, l.Sectors / 2, l.Sectors - 1} {
						if i < l.Sectors {
							idx = append(idx, i)
						}
					}
					for _, i := range idx {
						if got, want := g.dataPos(i), l.DataPos(i); got != want {
							t.Errorf("dataPos(%d) = %d, layout %d", i, got, want)
						}
						if !l.Authenticated() {
							continue
						}
						gg, gj := g.groupOf(i)
						lg, lj := l.GroupOf(i)
						if gg != lg || gj != lj {
							t.Errorf("groupOf(%d) = %d,%d, layout %d,%d", i, gg, gj, lg, lj)
						}
						if got, want := g.blockPos(gg), l.BlockPos(lg); got != want {
							t.Errorf("blockPos(%d) = %d, layout %d", gg, got, want)
						}
						if got, want := g.groupSectors(gg), l.GroupSectors(lg); got != want {
							t.Errorf("groupSectors(%d) = %d, layout %d", gg, got, want)
						}
					}
				})
			}
		}
	}
}

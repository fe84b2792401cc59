package blockdev

import (
	"math"

	"github.com/elidisk/eli/layout"
)

// geometry holds the numbers of the layout that the I/O paths need for every sector,
// computed once. layout.Layout derives each of them on every call, through sector.Mode's
// table lookups (about nine for one DataPos), which showed in the server's CPU profile
// of a sequential write (docs/benchmarks.md, "Measurements behind design choices").
type geometry struct {
	auth       bool   // sectors carry records
	sectorSize int64  // S
	dataOff    int64  // D
	metaBlock  int64  // M (0 without records)
	perGroup   uint64 // R (0 without records)
	groupLen   int64  // G
	sectors    uint64 // N

	// Format version 2: the data area nests tree nodes among the groups
	// (Layout.NodePos); units[m] is the length of a full unit of level m, 0 where it
	// exceeds any volume (only multiplied by a zero index then).
	tree  bool
	units [layout.TreeDepth]int64
}

func newGeometry(l Layout) geometry {
	g := geometry{
		auth:       l.Authenticated(),
		sectorSize: int64(l.SectorSize),
		dataOff:    l.DataOffset,
		metaBlock:  int64(l.MetaBlockSize()),
		perGroup:   uint64(l.RecordsPerGroup()),
		groupLen:   l.GroupLen(),
		sectors:    l.Sectors,
	}
	if l.Tree() {
		g.tree = true
		u := uint64(g.groupLen)
		for m := range g.units {
			if u <= math.MaxInt64/2 {
				g.units[m] = int64(u)
			}
			if u > (math.MaxInt64/2-layout.NodeSize)/layout.TreeArity {
				u = math.MaxInt64 // beyond any volume: stays out of units
			} else {
				u = layout.NodeSize + layout.TreeArity*u
			}
		}
	}
	return g
}

// groupOf is Layout.GroupOf (authenticated layouts only).
func (g *geometry) groupOf(i uint64) (uint64, int) {
	return i / g.perGroup, int(i % g.perGroup)
}

// groupSectors is Layout.GroupSectors (authenticated layouts only).
func (g *geometry) groupSectors(grp uint64) int {
	return int(min(g.perGroup, g.sectors-grp*g.perGroup))
}

// blockPos is Layout.BlockPos.
func (g *geometry) blockPos(grp uint64) int64 {
	if !g.tree {
		return g.dataOff + int64(grp)*g.groupLen
	}
	pos := g.dataOff + layout.TreeDepth*layout.NodeSize
	for m := 0; grp != 0; m++ {
		pos += int64(grp%layout.TreeArity) * g.units[m]
		grp /= layout.TreeArity
	}
	return pos
}

// dataPos is Layout.DataPos.
func (g *geometry) dataPos(i uint64) int64 {
	if !g.auth {
		return g.dataOff + int64(i)*g.sectorSize
	}
	grp, j := g.groupOf(i)
	return g.blockPos(grp) + g.metaBlock + int64(j)*g.sectorSize
}

package blockdev

import (
	"fmt"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/provider"
)

// Format prepares a new volume's journal and metadata for `eli init`: every record zero
// (every sector reads as zeroes) and no journal. Length-preserving modes have neither, so
// there is nothing to do. It never touches the header regions.
//
// On a regular file it punches out the journal and the whole data area: instant, and the
// file stays sparse. On a block device (or a provider that cannot punch) it zeroes the
// journal and each metadata block, about 1% of the data area, leaving the data sectors
// alone: their zero records make them read as zeroes. In format version 2 it zeroes the
// tree's nodes too: a tree of zero nodes over zero blocks has the zero root, which is what
// a journal that was never written stands for.
func Format(p provider.Provider, l Layout) error {
	if err := l.Validate(p.Size()); err != nil {
		return fmt.Errorf("format: %w", err)
	}
	if !l.Authenticated() {
		return nil
	}
	end := l.DataOffset + l.Span()
	caps := provider.CapabilitiesOf(p)
	if caps.Punch != nil && !caps.BlockDevice {
		if err := caps.Punch(l.JournalOffset(), end-l.JournalOffset()); err != nil {
			return fmt.Errorf("format: %w", err)
		}
		return syncFormat(p)
	}
	zero := func(off, n int64) error {
		if caps.Punch != nil {
			return caps.Punch(off, n)
		}
		for n > 0 {
			k := min(n, int64(len(zeroBuf)))
			if _, err := p.WriteAt(zeroBuf[:k], off); err != nil {
				return err
			}
			off, n = off+k, n-k
		}
		return nil
	}
	if err := zero(l.JournalOffset(), l.JournalLen); err != nil {
		return fmt.Errorf("format: zero journal: %w", err)
	}
	m := int64(l.MetaBlockSize())
	for g := range l.Groups() {
		if err := zero(l.BlockPos(g), m); err != nil {
			return fmt.Errorf("format: zero metadata block of group %d: %w", g, err)
		}
	}
	if l.Tree() {
		// Version 2: zero tree nodes, which make the zero root.
		geom := treeGeometry(l)
		for level := 1; level <= geom.Levels(); level++ {
			for k := range geom.Width(level) {
				if err := zero(l.NodePos(level, k), layout.NodeSize); err != nil {
					return fmt.Errorf("format: zero tree node %d/%d: %w", level, k, err)
				}
			}
		}
	}
	return syncFormat(p)
}

func syncFormat(p provider.Provider) error {
	if err := p.Sync(); err != nil {
		return fmt.Errorf("format: sync: %w", err)
	}
	return nil
}

package blockdev

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/elidisk/eli/blockdev/internal/tree"
	"github.com/elidisk/eli/layout"
)

// Freshness in format version 2 (docs/format.md, "Format version 2"; docs/design.md,
// "Where the design goes next"): a hash tree over the metadata blocks, whose root the journal carries with a
// generation that only grows. A metadata block enters the metadata cache only if its
// digest is the one the tree holds for it; a commit updates the tree once per round and
// writes the round's nodes with its records; recovery checks the tree on disk against the
// journal's root before it keeps anything from disk.

var (
	// ErrFreshness is metadata that does not match the hash tree of a format version 2
	// volume: a metadata block, tree node or journal put back from an older image, zeroed
	// or changed while eli was not writing it. Reads of the sectors it covers fail with it
	// (it wraps EIO); at Open it refuses the attach.
	ErrFreshness = fmt.Errorf("metadata does not match the volume's hash tree (replayed, zeroed or changed on the provider): %w", syscall.EIO)
	// ErrRolledBack is a provider older than the generation Config.MinGeneration asks for:
	// a whole-provider rollback, or another copy of the volume.
	ErrRolledBack = errors.New("provider is older than its witness")
)

// treeGeometry is the shape of a version 2 volume's tree: layout.TreeDepth levels however
// few its groups, so that growing the volume adds leaves (zero, never written) and nodes
// (zero, in the new area) and changes neither the root nor any node's place.
func treeGeometry(l Layout) tree.Geometry {
	return tree.NewFixedGeometry(l.Groups(), layout.TreeDepth)
}

// nodeStore reads tree nodes from their places in the data area.
type nodeStore struct{ a *authEngine }

func (s nodeStore) ReadNode(level int, index uint64, buf []byte) error {
	return s.a.readOnce(buf, s.a.l.NodePos(level, index))
}

// treeNodesFor is the bound on cached tree nodes for a metadata cache of blocks blocks: a
// level-1 node covers 128 groups, so a sixteenth of the blocks' count keeps the nodes above
// every cached block and more.
func treeNodesFor(blocks int) int { return max(64, blocks/16) }

// verifyBlock is the metadata cache's check of a block entering it.
func (a *authEngine) verifyBlock(g uint64, d tree.Digest) error {
	if a.tree == nil { // recovery: the tree is not known yet, recover2 checks itself
		return nil
	}
	if err := a.tree.Verify(g, d); err != nil {
		if errors.Is(err, tree.ErrMismatch) {
			if a.firstMismatch(g) {
				a.log.Error("metadata block does not match the hash tree", "group", g, "err", err)
			}
			return fmt.Errorf("%w (%v)", ErrFreshness, err)
		}
		return err
	}
	return nil
}

// firstMismatch reports whether group g's mismatch is new, so that each is logged once
// however often it is read (up to a bound, past which every one is logged).
func (a *authEngine) firstMismatch(g uint64) bool {
	a.mismatchMu.Lock()
	defer a.mismatchMu.Unlock()
	if a.mismatched == nil {
		a.mismatched = make(map[uint64]bool)
	}
	if a.mismatched[g] {
		return false
	}
	if len(a.mismatched) < 4096 {
		a.mismatched[g] = true
	}
	return true
}

// applyOverrides puts the records that a read-only recovery kept in memory into a block
// loaded from the provider (format version 2, where the block's digest must cover them).
func (a *authEngine) applyOverrides(g uint64, buf []byte) {
	first := g * a.geo.perGroup
	for j := range a.geo.groupSectors(g) {
		if r, ok := a.overrides[first+uint64(j)]; ok {
			copy(buf[j*len(r):], r[:])
		}
	}
}

// freshness returns the generation and root of the newest completed commit.
func (a *authEngine) freshness() (Freshness, bool) {
	if a.tree == nil {
		return Freshness{}, false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.fresh, true
}

// setFresh records that the journal's current generation and root are durable.
func (a *authEngine) setFresh() {
	a.mu.Lock()
	a.fresh = Freshness{Generation: a.jrnl.gen, Root: a.jrnl.root}
	a.mu.Unlock()
}

// reportFresh tells Config.OnFlushed the durable generation and root. Flushes finish
// concurrently: the calls are serialized, and a generation already reported is not
// reported again, so a witness never sees one go backwards.
func (a *authEngine) reportFresh() {
	if a.onFlushed == nil {
		return
	}
	a.reportMu.Lock()
	defer a.reportMu.Unlock()
	f, ok := a.freshness()
	if !ok || (a.reportedAny && f.Generation <= a.reported) {
		return
	}
	a.reported, a.reportedAny = f.Generation, true
	a.onFlushed(f.Generation, f.Root)
}

// recover2 is recovery for format version 2 (docs/format.md, "Format version 2", "Journal"):
//
//  1. the newest journal slot that opens gives the generation, the root and the last
//     round's entries; a generation below Config.MinGeneration refuses the attach;
//  2. the tree on disk, with every entry's *new* record in its metadata block, must have
//     the journal's root: this authenticates every node and record recovery keeps from
//     disk, so a replayed journal, or nodes or blocks changed while eli was down, refuse the
//     attach instead of being sealed into a new root;
//  3. each entry then keeps its new record if the sector's data opens with it, its old one
//     otherwise (as in version 1); if some went back to the old record, the tree is updated
//     and a new slot (the next generation, whose entries say the chosen records) carries
//     the new root before anything is written in place;
//  4. blocks and nodes are written in place and synced. A crash anywhere in this is
//     repaired by the next attach from the same (or the new) slot.
func (a *authEngine) recover2(minGen uint64) error {
	cur, torn, err := a.jrnl.read2(a.p, a.l.Sectors)
	if err != nil {
		return err
	}
	if cur.gen < minGen {
		return fmt.Errorf("%w: the provider is at generation %d, its witness at %d (restored from an older image, or another copy of the volume?)",
			ErrRolledBack, cur.gen, minGen)
	}
	switch {
	case cur.state != "open" && torn != "":
		a.rec.Journal = "torn"
	case cur.state != "open":
		a.rec.Journal = "zero"
	case len(cur.entries) == 0:
		a.rec.Journal = "empty"
	default:
		a.rec = Recovery{Journal: "replayed", Sectors: len(cur.entries), InMemory: a.ro}
	}
	geom := treeGeometry(a.l)
	maxNodes := treeNodesFor(a.cache.capacity())
	if len(cur.entries) == 0 {
		t, _, err := tree.Recover(geom, nodeStore{a}, nil, maxNodes)
		if err != nil {
			return err
		}
		if t.Root() != cur.root {
			return fmt.Errorf("%w: the tree's top node does not have the root of journal generation %d", ErrFreshness, cur.gen)
		}
		a.tree = t
		a.fresh = Freshness{Generation: cur.gen, Root: cur.root}
		return nil
	}

	// 2. Blocks with every entry's new record; the cache does not verify them yet.
	var blocks []*mblock
	byGroup := make(map[uint64]*mblock)
	defer func() {
		for _, b := range blocks {
			a.cache.unpin(b)
		}
	}()
	for _, e := range cur.entries {
		g, j := a.geo.groupOf(e.index)
		b := byGroup[g]
		if b == nil {
			if b, err = a.cache.get(g); err != nil {
				return err
			}
			byGroup[g] = b
			blocks = append(blocks, b)
		}
		a.cache.patch(b, j, &e.new)
	}
	leaves := make([]tree.Leaf, len(blocks))
	for k, b := range blocks {
		leaves[k] = tree.Leaf{Index: b.g, Digest: a.cache.digest(b)}
	}
	t, tc, err := tree.Recover(geom, nodeStore{a}, leaves, maxNodes+len(blocks)*geom.Levels())
	if err != nil {
		return err
	}
	if t.Root() != cur.root {
		return fmt.Errorf("%w: the tree with the last round's records does not have the root of journal generation %d", ErrFreshness, cur.gen)
	}

	// 3. Choose.
	buf := make([]byte, a.s)
	chosen := make([]journalEntry, len(cur.entries))
	changed := make(map[uint64]bool)
	for k, e := range cur.entries {
		choice, err := a.choose(e, buf)
		if err != nil {
			return err
		}
		chosen[k] = journalEntry{index: e.index, old: choice, new: choice}
		if choice == e.new {
			a.rec.RolledForward++
			continue
		}
		a.rec.RolledBack++
		g, j := a.geo.groupOf(e.index)
		a.cache.patch(byGroup[g], j, &choice)
		changed[g] = true
	}
	commits := []*tree.Commit{tc}
	if len(changed) > 0 {
		var back []tree.Leaf
		for _, b := range blocks {
			if changed[b.g] {
				back = append(back, tree.Leaf{Index: b.g, Digest: a.cache.digest(b)})
			}
		}
		tc2, err := t.Update(back)
		if err != nil {
			return err
		}
		commits = append(commits, tc2)
	}
	a.tree = t
	r := a.rec
	a.log.Info("journal: recovered the last commit", "generation", cur.gen, "sectors", r.Sectors,
		"rolled_forward", r.RolledForward, "rolled_back", r.RolledBack, "in_memory_only", r.InMemory)
	if a.ro {
		// The recovered nodes stay pinned (never Written), and blocks loaded again get
		// the chosen records from overrides before their digest is checked.
		a.overrides = make(map[uint64]record, len(chosen))
		for _, e := range chosen {
			a.overrides[e.index] = e.new
		}
		a.fresh = Freshness{Generation: cur.gen, Root: t.Root()}
		return nil
	}
	if len(changed) > 0 {
		// The new root must be durable before any block or node holds it.
		if err := a.writeJournal2(chosen); err != nil {
			return err
		}
	}
	if err := a.writeBlocks(blocks, commits...); err != nil {
		return err
	}
	for _, c := range commits {
		t.Written(c)
	}
	// The recovered round is served from now on: complete it, so that no later recovery
	// can take its old records back (markCompleted).
	if err := a.markCompleted(); err != nil {
		return err
	}
	return nil
}

// writeJournal2 seals entries with the tree's current root into the next generation's
// slot, writes it and syncs.
func (a *authEngine) writeJournal2(entries []journalEntry) error {
	buf, off, err := a.jrnl.encode2(entries, a.tree.Root())
	if err != nil {
		return err
	}
	if err := a.writeTearable(buf, off); err != nil {
		return fmt.Errorf("write journal: %w", err)
	}
	return a.timedSync()
}

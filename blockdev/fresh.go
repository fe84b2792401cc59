package blockdev

import (
	"errors"
	"fmt"
	"sync"
	"syscall"

	"github.com/elidisk/eli/blockdev/internal/tree"
	"github.com/elidisk/eli/layout"
)

// Freshness in format version 2 (docs/format.md, "Format version 2"; docs/design.md,
// "Freshness"): a hash tree over the metadata blocks, whose root the journal carries with
// a generation that only grows. A metadata block enters the metadata cache only if its
// digest is the one the tree holds for it; a commit updates the tree once per round and
// writes the round's nodes with its records; recovery checks the tree on disk against the
// journal's root before it keeps anything from disk.

// freshness is what a format version keeps beside the records to tell the current
// metadata from an older copy put back: nothing in version 1 (noFreshness), a hash tree
// in version 2 (treeFreshness). The engine calls it at each step where the versions
// differ, and never asks which version it has; newFreshness, at Open, is where that is
// decided.
type freshness interface {
	// verifier is the metadata cache's check of a block's digest as it enters the cache;
	// nil: the cache keeps no digests, and commits hand update no leaves.
	verifier() func(g uint64, d tree.Digest) error
	// recover runs recovery from the journal at Open, with the engine's parts (its
	// cache, journal and committer), refusing a provider older than minGen
	// (Config.MinGeneration).
	recover(a *authEngine, minGen uint64) error
	// update takes the new digests of the blocks a commit round changed, before the
	// round's journal is written, and returns the nodes to write in place beside the
	// blocks (nil: none).
	update(leaves []tree.Leaf) (*tree.Commit, error)
	// root is what the next journal write carries.
	root() [32]byte
	// written is told that a round's nodes tc are on the provider.
	written(tc *tree.Commit)
	// slotDurable is told that the journal's newest write is durable.
	slotDurable()
	// current is the generation and root of the newest durable journal slot (ok false
	// in version 1, which has neither).
	current() (f Freshness, ok bool)
	// report tells Config.OnFlushed what current says, if it is new (after a Flush).
	report()
}

// newFreshness is the freshness of c's format version.
func newFreshness(c *core, jrnl *journal, cfg Config) (freshness, error) {
	if !c.l.Tree() {
		if cfg.MinGeneration > 0 {
			return nil, fmt.Errorf("a minimum generation (%d) was given, but a format version 1 volume has no generation", cfg.MinGeneration)
		}
		return noFreshness{}, nil
	}
	return &treeFreshness{core: c, jrnl: jrnl, onFlushed: cfg.OnFlushed}, nil
}

// noFreshness is version 1's: records and a journal, nothing that tells an older copy of
// them from the current one. Its recovery replays the journal alone (recover.go).
type noFreshness struct{}

func (noFreshness) verifier() func(uint64, tree.Digest) error { return nil }
func (noFreshness) update([]tree.Leaf) (*tree.Commit, error)  { return nil, nil }
func (noFreshness) root() (r [32]byte)                        { return r }
func (noFreshness) written(*tree.Commit)                      {}
func (noFreshness) slotDurable()                              {}
func (noFreshness) current() (Freshness, bool)                { return Freshness{}, false }
func (noFreshness) report()                                   {}

// treeFreshness is version 2's: the hash tree, the generation and root of the newest
// durable journal slot, which Config.OnFlushed is told of, and the log of blocks that do
// not match the tree.
type treeFreshness struct {
	*core
	jrnl      *journal
	tree      *tree.Tree // set by recover
	onFlushed func(gen uint64, root [32]byte)

	mu  sync.Mutex
	cur Freshness // the newest durable journal slot's

	reportMu    sync.Mutex // serializes onFlushed calls
	reported    uint64     // the newest generation reported
	reportedAny bool

	mismatchMu sync.Mutex
	mismatched map[uint64]bool // groups whose mismatch was logged
}

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
type nodeStore struct{ c *core }

func (s nodeStore) ReadNode(level int, index uint64, buf []byte) error {
	return s.c.readOnce(buf, s.c.l.NodePos(level, index))
}

// treeNodesFor is the bound on cached tree nodes for a metadata cache of blocks blocks: a
// level-1 node covers 128 groups, so a sixteenth of the blocks' count keeps the nodes above
// every cached block and more.
func treeNodesFor(blocks int) int { return max(64, blocks/16) }

func (f *treeFreshness) verifier() func(uint64, tree.Digest) error { return f.verifyBlock }

// verifyBlock is the metadata cache's check of a block entering it.
func (f *treeFreshness) verifyBlock(g uint64, d tree.Digest) error {
	if f.tree == nil { // recovery: the tree is not known yet, recover checks itself
		return nil
	}
	if err := f.tree.Verify(g, d); err != nil {
		if errors.Is(err, tree.ErrMismatch) {
			if f.firstMismatch(g) {
				f.log.Error("metadata block does not match the hash tree", "group", g, "err", err)
			}
			return fmt.Errorf("%w (%v)", ErrFreshness, err)
		}
		return err
	}
	return nil
}

// firstMismatch reports whether group g's mismatch is new, so that each is logged once
// however often it is read (up to a bound, past which every one is logged).
func (f *treeFreshness) firstMismatch(g uint64) bool {
	f.mismatchMu.Lock()
	defer f.mismatchMu.Unlock()
	if f.mismatched == nil {
		f.mismatched = make(map[uint64]bool)
	}
	if f.mismatched[g] {
		return false
	}
	if len(f.mismatched) < 4096 {
		f.mismatched[g] = true
	}
	return true
}

func (f *treeFreshness) update(leaves []tree.Leaf) (*tree.Commit, error) {
	tc, err := f.tree.Update(leaves)
	if err != nil {
		return nil, fmt.Errorf("update hash tree: %w", err)
	}
	return tc, nil
}

func (f *treeFreshness) root() [32]byte { return f.tree.Root() }

func (f *treeFreshness) written(tc *tree.Commit) {
	if tc != nil {
		f.tree.Written(tc)
	}
}

// slotDurable records that the journal's current generation and root are durable.
func (f *treeFreshness) slotDurable() {
	f.mu.Lock()
	f.cur = Freshness{Generation: f.jrnl.gen, Root: f.jrnl.root}
	f.mu.Unlock()
}

func (f *treeFreshness) current() (Freshness, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.cur, true
}

// report tells Config.OnFlushed the durable generation and root. Flushes finish
// concurrently: the calls are serialized, and a generation already reported is not
// reported again, so a witness never sees one go backwards.
func (f *treeFreshness) report() {
	if f.onFlushed == nil {
		return
	}
	f.reportMu.Lock()
	defer f.reportMu.Unlock()
	cur, _ := f.current()
	if f.reportedAny && cur.Generation <= f.reported {
		return
	}
	f.reported, f.reportedAny = cur.Generation, true
	f.onFlushed(cur.Generation, cur.Root)
}

// recover is recovery for format version 2 (docs/format.md, "Format version 2", "Journal"):
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
func (f *treeFreshness) recover(a *authEngine, minGen uint64) error {
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
		return f.replay(a, cur)
	}
	t, _, err := tree.Recover(treeGeometry(a.l), nodeStore{f.core}, nil, treeNodesFor(a.cache.capacity()))
	if err != nil {
		return err
	}
	if t.Root() != cur.root {
		return fmt.Errorf("%w: the tree's top node does not have the root of journal generation %d", ErrFreshness, cur.gen)
	}
	f.tree = t
	f.cur = Freshness{Generation: cur.gen, Root: cur.root}
	return nil
}

// replay is recover's steps 2 to 4 for slot cur, which holds entries.
func (f *treeFreshness) replay(a *authEngine, cur slotState) error {
	// 2. Blocks with every entry's new record; the cache does not verify them yet.
	blocks, byGroup, err := f.withNew(a, cur.entries)
	defer func() {
		for _, b := range blocks {
			a.cache.unpin(b)
		}
	}()
	if err != nil {
		return err
	}
	geom := treeGeometry(a.l)
	maxNodes := treeNodesFor(a.cache.capacity()) + len(blocks)*geom.Levels()
	t, tc, err := tree.Recover(geom, nodeStore{f.core}, a.cache.leaves(blocks, nil), maxNodes)
	if err != nil {
		return err
	}
	if t.Root() != cur.root {
		return fmt.Errorf("%w: the tree with the last round's records does not have the root of journal generation %d", ErrFreshness, cur.gen)
	}

	// 3. Choose.
	chosen, changed, err := f.chooseAll(a, cur.entries, byGroup)
	if err != nil {
		return err
	}
	commits := []*tree.Commit{tc}
	if len(changed) > 0 {
		tc2, err := t.Update(a.cache.leaves(blocks, changed))
		if err != nil {
			return err
		}
		commits = append(commits, tc2)
	}
	f.tree = t
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
		// What it reports is the provider's state, the slot's: a root with sectors rolled
		// back exists only in this memory until a writable attach puts it in the next
		// generation's slot, and a witness that recorded it beside this generation would
		// see a fork in the provider that holds the slot.
		f.cur = Freshness{Generation: cur.gen, Root: cur.root}
		return nil
	}

	// 4. In place.
	if len(changed) > 0 {
		// The new root must be durable before any block or node holds it.
		if err := a.commits.writeJournal(chosen); err != nil {
			return err
		}
	}
	if err := a.commits.writeBlocks(blocks, commits...); err != nil {
		return err
	}
	for _, c := range commits {
		t.Written(c)
	}
	// The recovered round is served from now on: complete it, so that no later recovery
	// can take its old records back (markCompleted).
	return a.commits.markCompleted()
}

// withNew loads and pins the metadata blocks of entries, by group, and puts every entry's
// new record into its block. It returns the blocks pinned, also when it fails.
func (f *treeFreshness) withNew(a *authEngine, entries []journalEntry) ([]*mblock, map[uint64]*mblock, error) {
	var blocks []*mblock
	byGroup := make(map[uint64]*mblock)
	for _, e := range entries {
		g, j := a.geo.groupOf(e.index)
		b := byGroup[g]
		if b == nil {
			var err error
			if b, err = a.cache.get(g); err != nil {
				return blocks, nil, err
			}
			byGroup[g] = b
			blocks = append(blocks, b)
		}
		a.cache.patch(b, j, &e.new)
	}
	return blocks, byGroup, nil
}

// chooseAll chooses each entry's record (authEngine.choose) and puts those that went back
// to the old one into its block (byGroup, from withNew). It returns the entries as a
// journal that names the chosen records, and the groups whose block changed.
func (f *treeFreshness) chooseAll(a *authEngine, entries []journalEntry, byGroup map[uint64]*mblock) ([]journalEntry, map[uint64]bool, error) {
	buf := make([]byte, a.s)
	chosen := make([]journalEntry, len(entries))
	changed := make(map[uint64]bool)
	for k, e := range entries {
		choice, err := a.choose(e, buf)
		if err != nil {
			return nil, nil, err
		}
		chosen[k] = journalEntry{index: e.index, old: choice, new: choice}
		if choice != e.new {
			g, j := a.geo.groupOf(e.index)
			a.cache.patch(byGroup[g], j, &choice)
			changed[g] = true
		}
	}
	return chosen, changed, nil
}

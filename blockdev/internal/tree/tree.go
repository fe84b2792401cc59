package tree

import (
	"cmp"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sync"
)

// Geometry is the shape of a tree over a number of leaves: level 0 holds the leaves,
// level l ≥ 1 holds ceil(width(l−1) / Arity) nodes, and the top level holds one node, whose
// digest is the root. There is always at least one interior level.
type Geometry struct {
	widths []uint64
}

// NewGeometry is the geometry of a tree over leaves ≥ 1 leaves.
func NewGeometry(leaves uint64) Geometry {
	if leaves == 0 {
		panic("tree: no leaves")
	}
	w := []uint64{leaves}
	for len(w) == 1 || w[len(w)-1] > 1 {
		prev := w[len(w)-1]
		w = append(w, (prev+Arity-1)/Arity)
	}
	return Geometry{widths: w}
}

// NewFixedGeometry is the geometry of a tree over leaves ≥ 1 leaves with exactly levels
// interior levels, the top one a single node, however few the leaves: a tree that keeps
// its shape, and its root, when leaves are added (their digests zero). It panics if
// Arity^levels leaves do not cover leaves.
func NewFixedGeometry(leaves uint64, levels int) Geometry {
	if leaves == 0 || levels < 1 {
		panic("tree: no leaves or no levels")
	}
	w := []uint64{leaves}
	for range levels {
		prev := w[len(w)-1]
		w = append(w, (prev+Arity-1)/Arity)
	}
	if w[len(w)-1] != 1 {
		panic("tree: too many leaves for the levels")
	}
	return Geometry{widths: w}
}

// Levels is the number of interior levels; the top node is at level Levels().
func (g Geometry) Levels() int { return len(g.widths) - 1 }

// Width is the number of blocks at a level (level 0: the leaves).
func (g Geometry) Width(level int) uint64 { return g.widths[level] }

// Nodes is the number of interior nodes, what a Store must hold.
func (g Geometry) Nodes() uint64 {
	var n uint64
	for _, w := range g.widths[1:] {
		n += w
	}
	return n
}

// ErrMismatch is a block whose digest is not the one the tree holds for it: tampered,
// replayed from an older image, or zeroed.
var ErrMismatch = errors.New("hash tree mismatch")

// Store reads interior nodes. A node never written reads as NodeSize zero bytes.
type Store interface {
	ReadNode(level int, index uint64, buf []byte) error
}

type nodeKey struct {
	level int
	index uint64
}

type node struct {
	key     nodeKey
	data    []byte
	h       Hasher
	dirty   uint64 // pieces setSlot changed since h last saw them
	pending int    // Updates whose writes are not yet Written: not evictable
	// prev and next link n into the tree's lru while it is evictable (nil otherwise).
	prev, next *node
}

// A node's pieces fit dirty's bits.
const _ = uint64(64 - NodeSize/PieceSize)

// setSlot puts d into slot of n. Its piece is rehashed by digest: once, however many of
// the piece's 16 slots a commit changes (a level-1 node takes a slot per metadata block,
// and a commit of random writes changes many blocks under one node).
func (n *node) setSlot(slot int, d Digest) {
	off := slot * DigestSize
	copy(n.data[off:], d[:])
	n.dirty |= 1 << (off / PieceSize)
}

// digest is n's digest, after rehashing the pieces setSlot changed.
func (n *node) digest() Digest {
	for d := n.dirty; d != 0; d &= d - 1 {
		n.h.Update(n.data, bits.TrailingZeros64(d)*PieceSize, PieceSize)
	}
	n.dirty = 0
	return n.h.Digest(n.key.level, n.key.index)
}

// hashUp sets the leaves' digests in their level-1 nodes and recomputes the nodes of keys
// (every node on the leaves' paths, bottom up as pathKeys orders them) and the root.
func (t *Tree) hashUp(leaves []Leaf, keys []nodeKey) {
	for _, l := range leaves {
		t.nodes[nodeKey{1, l.Index / Arity}].setSlot(int(l.Index%Arity), l.Digest)
	}
	for _, k := range keys {
		d := t.nodes[k].digest()
		if k.level == t.geom.Levels() {
			t.root = d
			continue
		}
		pk, slot := t.parentOf(k)
		t.nodes[pk].setSlot(slot, d)
	}
}

// Tree verifies leaves against a root and updates it. Verified interior nodes are cached,
// least recently used out, within a bound; nodes an Update changed stay cached until
// their write is reported done, so that a node is never read back from the store older
// than its parent's digest of it. Verify may run concurrently with anything; Update and
// Written are the committer's and must not overlap each other.
type Tree struct {
	geom  Geometry
	store Store

	mu    sync.Mutex
	root  Digest
	nodes map[nodeKey]*node
	lru   node // the ring of evictable nodes, most recent at lru.next
	max   int
	epoch uint64 // counts Written calls: a node read before one may be stale
	spare [][]byte
	// spareCommit is a Commit that Written returned, for the next Update: a commit
	// allocates nothing for its keys and node writes once the tree is warm.
	spareCommit *Commit
}

// New is the tree with geometry g over store, whose current root is root (the all-zero
// digest for a tree never written). At most maxNodes nodes stay cached beyond those that
// pending writes pin (at least one per level).
func New(g Geometry, store Store, root Digest, maxNodes int) *Tree {
	t := &Tree{
		geom:  g,
		store: store,
		root:  root,
		nodes: make(map[nodeKey]*node),
		max:   max(maxNodes, g.Levels()+1),
	}
	t.lru.prev, t.lru.next = &t.lru, &t.lru
	return t
}

// Root is the current root digest.
func (t *Tree) Root() Digest {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.root
}

// Geometry is the tree's geometry.
func (t *Tree) Geometry() Geometry { return t.geom }

// Cached is how many nodes are in memory.
func (t *Tree) Cached() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.nodes)
}

func (t *Tree) parentOf(k nodeKey) (nodeKey, int) {
	return nodeKey{k.level + 1, k.index / Arity}, int(k.index % Arity)
}

func slotDigest(n *node, slot int) (d Digest) {
	copy(d[:], n.data[slot*DigestSize:])
	return d
}

// Verify checks that leaf index has digest d under the current root. It fails with an
// error wrapping ErrMismatch when it does not, or when a node on the way does not match
// its parent.
func (t *Tree) Verify(index uint64, d Digest) error {
	if index >= t.geom.Width(0) {
		return fmt.Errorf("tree: leaf %d of %d", index, t.geom.Width(0))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	n, err := t.nodeLocked(nodeKey{1, index / Arity})
	if err != nil {
		return err
	}
	t.touch(n)
	if got := slotDigest(n, int(index%Arity)); got != d {
		return fmt.Errorf("leaf %d: %w", index, ErrMismatch)
	}
	return nil
}

// nodeLocked returns node k, verified, from the cache or the store. It drops t.mu while
// it reads the store, and starts again if a Written call in the meantime may have made
// what it read stale.
func (t *Tree) nodeLocked(k nodeKey) (*node, error) {
	for {
		if n := t.nodes[k]; n != nil {
			return n, nil
		}
		// The path from k up to the lowest cached ancestor (or the top).
		var missing []nodeKey
		for p := k; ; {
			missing = append(missing, p)
			if p.level == t.geom.Levels() {
				break
			}
			p, _ = t.parentOf(p)
			if t.nodes[p] != nil {
				break
			}
		}
		epoch := t.epoch
		bufs := make([][]byte, len(missing))
		t.mu.Unlock()
		var err error
		for i, m := range missing {
			bufs[i] = t.getBuf()
			if err = t.store.ReadNode(m.level, m.index, bufs[i]); err != nil {
				err = fmt.Errorf("read tree node %d/%d: %w", m.level, m.index, err)
				break
			}
		}
		t.mu.Lock()
		if err != nil {
			return nil, err
		}
		// Top down: each read node against its parent's digest of it.
		stale := false
		for i := len(missing) - 1; i >= 0; i-- {
			m := missing[i]
			if t.nodes[m] != nil { // inserted meanwhile by another reader or the committer
				continue
			}
			n := &node{key: m, data: bufs[i]}
			n.h.Reset(n.data)
			want := t.root
			if m.level < t.geom.Levels() {
				pk, slot := t.parentOf(m)
				p := t.nodes[pk]
				if p == nil { // evicted while the lock was dropped: start again
					stale = true
					break
				}
				want = slotDigest(p, slot)
			}
			if n.h.Digest(m.level, m.index) != want {
				if t.epoch != epoch {
					stale = true
					break
				}
				return nil, fmt.Errorf("tree node %d/%d: %w", m.level, m.index, ErrMismatch)
			}
			t.insert(n)
		}
		if !stale {
			return t.nodes[k], nil
		}
	}
}

func (t *Tree) getBuf() []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	if n := len(t.spare); n > 0 {
		b := t.spare[n-1]
		t.spare = t.spare[:n-1]
		return b
	}
	return make([]byte, NodeSize)
}

func (t *Tree) insert(n *node) {
	t.nodes[n.key] = n
	t.pushFront(n)
	t.evict(n)
}

// evict drops least recently used unpinned nodes beyond the bound, never keep.
func (t *Tree) evict(keep *node) {
	for len(t.nodes) > t.max {
		old := t.lru.prev
		if old == &t.lru || old == keep {
			break
		}
		t.unlink(old)
		delete(t.nodes, old.key)
		if len(t.spare) < 8 {
			t.spare = append(t.spare, old.data)
		}
	}
}

// touch makes an evictable n the most recently used.
func (t *Tree) touch(n *node) {
	if n.next != nil {
		t.unlink(n)
		t.pushFront(n)
	}
}

// pushFront links n into lru as the most recently used.
func (t *Tree) pushFront(n *node) {
	n.prev, n.next = &t.lru, t.lru.next
	n.next.prev = n
	t.lru.next = n
}

// unlink takes n out of lru.
func (t *Tree) unlink(n *node) {
	n.prev.next, n.next.prev = n.next, n.prev
	n.prev, n.next = nil, nil
}

// Leaf is a leaf's new digest.
type Leaf struct {
	Index  uint64
	Digest Digest
}

// NodeWrite is an interior node an Update changed: write Data at (Level, Index).
type NodeWrite struct {
	Level int
	Index uint64
	// Data is the cached node itself, pinned: the caller reads it (to write it) and
	// never changes it. It holds the node's newest content until Written, so it is not a
	// snapshot: a later Update before Written changes it (and writes it again).
	Data []byte
}

// Commit is what an Update changed: the nodes to write and the new root.
type Commit struct {
	Root  Digest
	Nodes []NodeWrite
	keys  []nodeKey
}

// Update sets the digests of leaves and recomputes every node above them, each once, bottom
// up. The tree holds the new root at once (Verify checks against it); the caller writes
// the nodes, makes them durable with the root, and then calls Written. Until then the
// changed nodes stay in memory. On error the tree is unchanged.
func (t *Tree) Update(leaves []Leaf) (*Commit, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	c := t.spareCommit
	t.spareCommit = nil
	if c == nil {
		c = &Commit{}
	}
	c.Root = t.root
	if len(leaves) == 0 {
		return c, nil
	}
	// Load (and verify) every node that will change before changing any: a failure then
	// leaves the tree as it was.
	keys, err := pathKeys(c.keys[:0], t.geom, leaves)
	if err != nil {
		return nil, err
	}
	c.keys = keys
	// Loaded top down, so that each node's parent is there to verify it against. Pin
	// each node as it is loaded, so that loading the next cannot evict it.
	for i := len(keys) - 1; i >= 0; i-- {
		n, err := t.nodeLocked(keys[i])
		if err != nil {
			for _, p := range keys[i+1:] {
				t.unpin(t.nodes[p])
			}
			c.keys = c.keys[:0]
			t.spareCommit = c
			return nil, err
		}
		t.pin(n)
	}
	t.hashUp(leaves, keys)
	c.Root = t.root
	for _, k := range keys {
		c.Nodes = append(c.Nodes, NodeWrite{Level: k.level, Index: k.index, Data: t.nodes[k].data})
	}
	return c, nil
}

// Written says that c's nodes are durable in the store: they may be evicted again. c is
// the tree's again: the caller must not use it afterwards.
func (t *Tree) Written(c *Commit) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.epoch++
	for _, k := range c.keys {
		t.unpin(t.nodes[k])
	}
	t.evict(nil)
	// c is the caller's no longer: keep it, emptied, for the next Update.
	clear(c.Nodes) // drop the references to node data
	c.Nodes, c.keys = c.Nodes[:0], c.keys[:0]
	t.spareCommit = c
}

func (t *Tree) pin(n *node) {
	if n.next != nil {
		t.unlink(n)
	}
	n.pending++
}

func (t *Tree) unpin(n *node) {
	if n.pending--; n.pending == 0 {
		t.pushFront(n)
	}
}

// pathKeys is every interior node on the paths from leaves to the top, and the top node
// itself, each once: bottom up, and in index order within a level. It reuses keys'
// memory.
func pathKeys(keys []nodeKey, g Geometry, leaves []Leaf) ([]nodeKey, error) {
	keys = keys[:0]
	for _, l := range leaves {
		if l.Index >= g.Width(0) {
			return nil, fmt.Errorf("tree: leaf %d of %d", l.Index, g.Width(0))
		}
		keys = append(keys, nodeKey{1, l.Index / Arity})
	}
	// A commit's leaves come in index order, so this is mostly a check.
	if !slices.IsSortedFunc(keys, compareKeys) {
		slices.SortFunc(keys, compareKeys)
	}
	keys = slices.Compact(keys)
	if len(keys) == 0 {
		return append(keys, nodeKey{g.Levels(), 0}), nil
	}
	// Each level's parents, in index order as their children are.
	for lo := 0; keys[lo].level < g.Levels(); {
		hi := len(keys)
		for i := lo; i < hi; i++ {
			p := nodeKey{keys[i].level + 1, keys[i].index / Arity}
			if len(keys) == hi || keys[len(keys)-1] != p {
				keys = append(keys, p)
			}
		}
		lo = hi
	}
	return keys, nil
}

func compareKeys(a, b nodeKey) int {
	return cmp.Or(cmp.Compare(a.level, b.level), cmp.Compare(a.index, b.index))
}

// Recover is the tree whose interior nodes are those the store holds now, with the leaves'
// digests set: every node on their paths is read without verification, patched, and hashed
// up to a root. It is for crash recovery, where the nodes on the paths of the interrupted
// commit may be old, new or torn on disk while every other slot of theirs is the same in
// both versions: so the recomputed root is the journal's root exactly when nothing else
// changed. The caller compares Root with the root it trusts before it keeps anything.
//
// The path nodes stay cached and pinned until Written(c); with no leaves, only the top
// node is read, and c has nothing to write.
func Recover(g Geometry, store Store, leaves []Leaf, maxNodes int) (*Tree, *Commit, error) {
	t := New(g, store, Digest{}, maxNodes)
	keys, err := pathKeys(nil, g, leaves)
	if err != nil {
		return nil, nil, err
	}
	for _, k := range keys {
		n := &node{key: k, data: make([]byte, NodeSize)}
		if err := store.ReadNode(k.level, k.index, n.data); err != nil {
			return nil, nil, fmt.Errorf("read tree node %d/%d: %w", k.level, k.index, err)
		}
		n.h.Reset(n.data)
		t.nodes[k] = n
	}
	t.hashUp(leaves, keys)
	c := &Commit{}
	for _, k := range keys {
		n := t.nodes[k]
		if len(leaves) == 0 {
			t.pushFront(n)
			continue
		}
		n.pending = 1
		c.keys = append(c.keys, k)
		c.Nodes = append(c.Nodes, NodeWrite{Level: k.level, Index: k.index, Data: n.data})
	}
	c.Root = t.root
	return t, c, nil
}

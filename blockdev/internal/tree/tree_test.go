package tree

import (
	"cmp"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

func TestGeometry(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		leaves uint64
		widths []uint64
	}{
		{1, []uint64{1, 1}},
		{Arity, []uint64{Arity, 1}},
		{Arity + 1, []uint64{Arity + 1, 2, 1}},
		{Arity * Arity, []uint64{Arity * Arity, Arity, 1}},
		{Arity*Arity + 1, []uint64{Arity*Arity + 1, Arity + 1, 2, 1}},
		// 16 TiB of 4 KiB sectors, 102 records per metadata block.
		{(1<<32 + 101) / 102, []uint64{42107523, 328966, 2571, 21, 1}},
	} {
		g := NewGeometry(c.leaves)
		if g.Levels() != len(c.widths)-1 {
			t.Errorf("%d leaves: %d levels, want %d", c.leaves, g.Levels(), len(c.widths)-1)
			continue
		}
		var nodes uint64
		for l, w := range c.widths {
			if g.Width(l) != w {
				t.Errorf("%d leaves: width(%d) = %d, want %d", c.leaves, l, g.Width(l), w)
			}
			if l > 0 {
				nodes += w
			}
		}
		if g.Nodes() != nodes {
			t.Errorf("%d leaves: %d nodes, want %d", c.leaves, g.Nodes(), nodes)
		}
	}
}

func TestHasherIncrementalMatchesScratch(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	for _, size := range []int{PieceSize, 4096, 65536} {
		block := make([]byte, size)
		var h Hasher
		h.Reset(block)
		if d := h.Digest(0, 7); !d.IsZero() {
			t.Fatalf("%d: all-zero block has digest %x, want zero", size, d)
		}
		for i := 0; i < 200; i++ {
			off := rng.IntN(size)
			n := rng.IntN(min(size-off, 100) + 1)
			if rng.IntN(4) == 0 {
				clear(block[off : off+n]) // back towards zero, so that zero pieces are counted both ways
			} else {
				for j := off; j < off+n; j++ {
					block[j] = byte(rng.Uint32())
				}
			}
			h.Update(block, off, n)
			if got, want := h.Digest(0, 7), BlockDigest(0, 7, block); got != want {
				t.Fatalf("%d, step %d: incremental digest %x, from scratch %x", size, i, got, want)
			}
		}
		clear(block)
		h.Update(block, 0, size)
		if d := h.Digest(0, 7); !d.IsZero() {
			t.Fatalf("%d: block zeroed again has digest %x, want zero", size, d)
		}
	}
}

func TestDigestBindsPosition(t *testing.T) {
	t.Parallel()
	block := make([]byte, NodeSize)
	block[100] = 1
	seen := map[Digest]string{}
	for _, p := range []struct {
		level int
		index uint64
	}{{0, 0}, {0, 1}, {1, 0}, {1, 1}, {2, 0}, {0, 1 << 40}} {
		d := BlockDigest(p.level, p.index, block)
		if d.IsZero() {
			t.Fatalf("non-zero block at %v has the zero digest", p)
		}
		if prev, ok := seen[d]; ok {
			t.Fatalf("%v and %s share a digest", p, prev)
		}
		seen[d] = "earlier"
	}
}

// memStore is a Store in memory that counts reads and can fail them.
type memStore struct {
	mu    sync.Mutex
	nodes map[nodeKey][]byte
	reads atomic.Int64
	fail  atomic.Bool
}

func newMemStore() *memStore { return &memStore{nodes: map[nodeKey][]byte{}} }

func (s *memStore) ReadNode(level int, index uint64, buf []byte) error {
	s.reads.Add(1)
	if s.fail.Load() {
		return errors.New("injected read error")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if b, ok := s.nodes[nodeKey{level, index}]; ok {
		copy(buf, b)
	} else {
		clear(buf)
	}
	return nil
}

func (s *memStore) write(c *Commit) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, w := range c.Nodes {
		s.nodes[nodeKey{w.Level, w.Index}] = append([]byte(nil), w.Data...)
	}
}

func (s *memStore) snapshot() map[nodeKey][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := make(map[nodeKey][]byte, len(s.nodes))
	for k, v := range s.nodes {
		m[k] = append([]byte(nil), v...)
	}
	return m
}

func randDigest(rng *rand.Rand) (d Digest) {
	for i := range d {
		d[i] = byte(rng.Uint32())
	}
	return d
}

// commit updates tr, writes what it changed to s and reports it written.
func commit(t *testing.T, tr *Tree, s *memStore, leaves []Leaf) Digest {
	t.Helper()
	c, err := tr.Update(leaves)
	if err != nil {
		t.Fatal(err)
	}
	s.write(c)
	tr.Written(c)
	return c.Root
}

func TestTreeModel(t *testing.T) {
	t.Parallel()
	for _, leaves := range []uint64{1, 5, Arity, Arity + 3, 3*Arity*Arity + 17} {
		for _, maxNodes := range []int{1, 4, 1 << 20} {
			rng := rand.New(rand.NewPCG(leaves, uint64(maxNodes)))
			g := NewGeometry(leaves)
			s := newMemStore()
			tr := New(g, s, Digest{}, maxNodes)
			model := map[uint64]Digest{}
			for round := 0; round < 30; round++ {
				var batch []Leaf
				for i := rng.IntN(20); i >= 0; i-- {
					l := Leaf{Index: rng.Uint64N(leaves), Digest: randDigest(rng)}
					if rng.IntN(5) == 0 {
						l.Digest = Digest{} // a metadata block trimmed back to zero
					}
					batch = append(batch, l)
					model[l.Index] = l.Digest
				}
				commit(t, tr, s, batch)
			}
			// The tree in memory and a fresh one over the store agree with the model.
			fresh := New(g, s, tr.Root(), maxNodes)
			for idx, d := range model {
				for _, x := range []*Tree{tr, fresh} {
					if err := x.Verify(idx, d); err != nil {
						t.Fatalf("%d leaves, cache %d: leaf %d: %v", leaves, maxNodes, idx, err)
					}
				}
				var other Digest
				other[0] = 1
				if err := fresh.Verify(idx, other); !errors.Is(err, ErrMismatch) {
					t.Fatalf("%d leaves: wrong digest for leaf %d verified: %v", leaves, idx, err)
				}
			}
			// A leaf never written verifies as zero only.
			for i := uint64(0); i < min(leaves, 50); i++ {
				if _, ok := model[i]; ok {
					continue
				}
				if err := fresh.Verify(i, Digest{}); err != nil {
					t.Fatalf("%d leaves: unwritten leaf %d: %v", leaves, i, err)
				}
			}
			if maxNodes < 1<<20 && tr.Cached() > max(maxNodes, g.Levels()+1) {
				t.Errorf("%d leaves: %d nodes cached, bound %d", leaves, tr.Cached(), maxNodes)
			}
		}
	}
}

func TestSharedParentsHashedOnce(t *testing.T) {
	t.Parallel()
	g := NewGeometry(3 * Arity)
	s := newMemStore()
	tr := New(g, s, Digest{}, 100)
	rng := rand.New(rand.NewPCG(3, 4))
	var batch []Leaf
	for i := uint64(0); i < 3*Arity; i += 2 {
		batch = append(batch, Leaf{Index: i, Digest: randDigest(rng)})
	}
	c, err := tr.Update(batch)
	if err != nil {
		t.Fatal(err)
	}
	// 3 level-1 nodes and the top: each written once.
	if len(c.Nodes) != 4 {
		t.Fatalf("%d node writes for one commit over 3 level-1 nodes, want 4", len(c.Nodes))
	}
	tr.Written(c)
}

func TestEmptyTree(t *testing.T) {
	t.Parallel()
	g := NewGeometry(1000)
	tr := New(g, newMemStore(), Digest{}, 10)
	if err := tr.Verify(999, Digest{}); err != nil {
		t.Fatal(err)
	}
	var d Digest
	d[31] = 1
	if err := tr.Verify(999, d); !errors.Is(err, ErrMismatch) {
		t.Fatalf("a written leaf verified in a tree never written: %v", err)
	}
	if err := tr.Verify(1000, Digest{}); err == nil {
		t.Fatal("leaf past the end verified")
	}
}

// TestTamper changes the store as an attacker holding the provider can: every change
// that would bring back an old or a zeroed leaf is a mismatch.
func TestTamper(t *testing.T) {
	t.Parallel()
	leaves := uint64(Arity*Arity + 5)
	g := NewGeometry(leaves)
	rng := rand.New(rand.NewPCG(5, 6))
	s := newMemStore()
	tr := New(g, s, Digest{}, 1000)
	v1 := map[uint64]Digest{}
	var batch []Leaf
	for _, i := range []uint64{0, 1, Arity, Arity * Arity, leaves - 1} {
		d := randDigest(rng)
		batch = append(batch, Leaf{i, d})
		v1[i] = d
	}
	commit(t, tr, s, batch)
	old := s.snapshot()
	oldRoot := tr.Root()
	batch = batch[:0]
	v2 := map[uint64]Digest{}
	for i := range v1 {
		d := randDigest(rng)
		batch = append(batch, Leaf{i, d})
		v2[i] = d
	}
	root := commit(t, tr, s, batch)

	check := func(name string, mutate func(s *memStore), leaf uint64, d Digest) {
		t.Helper()
		s2 := newMemStore()
		s2.nodes = s.snapshot()
		mutate(s2)
		err := New(g, s2, root, 1000).Verify(leaf, d)
		if !errors.Is(err, ErrMismatch) {
			t.Errorf("%s: leaf %d verified (%v)", name, leaf, err)
		}
	}
	for k := range old {
		for i, d := range v2 { // every written leaf below node k
			span := uint64(1)
			for range k.level {
				span *= Arity
			}
			if i/span != k.index {
				continue
			}
			check("old node put back", func(s *memStore) { s.nodes[k] = old[k] }, i, d)
			check("node zeroed", func(s *memStore) { s.nodes[k] = make([]byte, NodeSize) }, i, d)
		}
	}
	none := func(*memStore) {}
	for i := range v1 {
		check("old leaf", none, i, v1[i])
		check("zeroed leaf", none, i, Digest{})
	}
	// The whole old tree with the old leaves is consistent only under the old root: that
	// rollback is the witness's to catch, outside the provider.
	s3 := newMemStore()
	s3.nodes = old
	for i, d := range v1 {
		if err := New(g, s3, oldRoot, 10).Verify(i, d); err != nil {
			t.Fatalf("old tree under old root: %v", err)
		}
		if err := New(g, s3, root, 10).Verify(i, d); !errors.Is(err, ErrMismatch) {
			t.Fatalf("old tree under the current root verified leaf %d: %v", i, err)
		}
	}
}

func TestUpdateFailureLeavesTreeUnchanged(t *testing.T) {
	t.Parallel()
	g := NewGeometry(Arity * Arity)
	s := newMemStore()
	tr := New(g, s, Digest{}, 2)
	rng := rand.New(rand.NewPCG(7, 8))
	d0 := randDigest(rng)
	root := commit(t, tr, s, []Leaf{{0, d0}})
	s.fail.Store(true)
	if _, err := tr.Update([]Leaf{{Arity * 100, randDigest(rng)}}); err == nil {
		t.Fatal("Update with a failing store succeeded")
	}
	s.fail.Store(false)
	if tr.Root() != root {
		t.Fatal("a failed Update changed the root")
	}
	if err := tr.Verify(0, d0); err != nil {
		t.Fatal(err)
	}
	d1 := randDigest(rng)
	root = commit(t, tr, s, []Leaf{{Arity * 100, d1}})
	if err := New(g, s, root, 2).Verify(Arity*100, d1); err != nil {
		t.Fatal(err)
	}
}

// TestVerifyDuringCommits runs readers against a committer with a cache too small to hold
// a path, so that readers keep reading nodes the committer is rewriting: a reader must
// never see a mismatch for a leaf that no commit changes.
func TestVerifyDuringCommits(t *testing.T) {
	t.Parallel()
	leaves := uint64(4 * Arity * Arity)
	g := NewGeometry(leaves)
	s := newMemStore()
	tr := New(g, s, Digest{}, 3)
	rng := rand.New(rand.NewPCG(9, 10))
	fixed := map[uint64]Digest{}
	var batch []Leaf
	for i := uint64(0); i < leaves; i += Arity*7 + 3 {
		d := randDigest(rng)
		fixed[i] = d
		batch = append(batch, Leaf{i, d})
	}
	commit(t, tr, s, batch)

	var stop atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for r := 0; r < 3; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				for i, d := range fixed {
					if err := tr.Verify(i, d); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	for round := 0; round < 300; round++ {
		var b []Leaf
		for j := 0; j < 5; j++ {
			i := rng.Uint64N(leaves)
			if _, ok := fixed[i]; ok {
				continue
			}
			b = append(b, Leaf{i, randDigest(rng)})
		}
		commit(t, tr, s, b)
	}
	stop.Store(true)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	fresh := New(g, s, tr.Root(), 3)
	for i, d := range fixed {
		if err := fresh.Verify(i, d); err != nil {
			t.Fatalf("after the commits, from the store: %v", err)
		}
	}
}

// TestRecover: after a commit interrupted with any subset of its nodes written (and torn
// halves), Recover with the commit's leaves finds the commit's root, and the recovered tree
// verifies every leaf; a leaf with another digest gives another root, and a node changed
// off the paths fails Verify of the leaves under it.
func TestRecover(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(5, 6))
	const leaves = Arity*Arity + 300
	g := NewGeometry(leaves)
	s := newMemStore()
	tr := New(g, s, Digest{}, 1000)
	model := map[uint64]Digest{}
	randLeaves := func(n int) []Leaf {
		seen := map[uint64]bool{}
		var ls []Leaf
		for len(ls) < n {
			i := rng.Uint64N(leaves)
			if seen[i] {
				continue
			}
			seen[i] = true
			ls = append(ls, Leaf{i, randDigest(rng)})
		}
		return ls
	}
	for range 20 {
		for _, l := range randLeaves(50) {
			model[l.Index] = l.Digest
		}
	}
	var all []Leaf
	for i, d := range model {
		all = append(all, Leaf{i, d})
	}
	commit(t, tr, s, all)
	for round := range 30 {
		before := s.snapshot()
		ls := randLeaves(1 + rng.IntN(40))
		c, err := tr.Update(ls)
		if err != nil {
			t.Fatal(err)
		}
		// Crash: some nodes written, some not, some torn.
		s.mu.Lock()
		for _, w := range c.Nodes {
			k := nodeKey{w.Level, w.Index}
			switch rng.IntN(3) {
			case 0:
				s.nodes[k] = append([]byte(nil), w.Data...)
			case 1:
				torn := append([]byte(nil), before[k]...)
				if torn == nil {
					torn = make([]byte, NodeSize)
				}
				copy(torn[:NodeSize/2], w.Data)
				s.nodes[k] = torn
			}
		}
		s.mu.Unlock()
		rt, rc, err := Recover(g, s, ls, 1000)
		if err != nil {
			t.Fatal(err)
		}
		if rt.Root() != c.Root {
			t.Fatalf("round %d: recovered root %x, want %x", round, rt.Root(), c.Root)
		}
		// A leaf of the commit with another digest than the journal says: another root.
		wrong := append([]Leaf(nil), ls...)
		wrong[0].Digest[0] ^= 1
		if bad, _, _ := Recover(g, s, wrong, 1000); bad.Root() == c.Root {
			t.Fatalf("round %d: a wrong leaf gives the same root", round)
		}
		s.write(rc)
		rt.Written(rc)
		tr.Written(c)
		for _, l := range ls {
			model[l.Index] = l.Digest
		}
		for i, d := range model {
			if err := rt.Verify(i, d); err != nil {
				t.Fatalf("round %d: leaf %d after recovery: %v", round, i, err)
			}
		}
		tr = rt
	}
	// A node off the paths changed on disk: another root.
	s.mu.Lock()
	var victim nodeKey
	for k, v := range s.nodes {
		if k.level == 1 {
			victim = k
			s.nodes[k] = append([]byte(nil), v...)
			s.nodes[k][5] ^= 1
			break
		}
	}
	s.mu.Unlock()
	rt, _, err := Recover(g, s, nil, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if rt.Root() != tr.Root() {
		// With no leaves Recover reads the top node alone.
		t.Fatalf("recover with no leaves changed the root")
	}
	if err := rt.Verify(victim.index*Arity, model[victim.index*Arity]); !errors.Is(err, ErrMismatch) {
		t.Errorf("leaf under a changed node: %v, want ErrMismatch", err)
	}
}

// TestFixedGeometry: a fixed-depth tree keeps its root when leaves with zero digests are
// added, which is what lets a volume grow without touching its tree.
func TestFixedGeometry(t *testing.T) {
	t.Parallel()
	g := NewFixedGeometry(300, 4)
	if g.Levels() != 4 || g.Width(1) != 3 || g.Width(2) != 1 || g.Width(4) != 1 {
		t.Fatalf("widths %v", g.widths)
	}
	s := newMemStore()
	tr := New(g, s, Digest{}, 100)
	rng := rand.New(rand.NewPCG(9, 9))
	leaves := []Leaf{{0, randDigest(rng)}, {299, randDigest(rng)}, {130, randDigest(rng)}}
	root := commit(t, tr, s, leaves)
	grown := New(NewFixedGeometry(128*128*3, 4), s, root, 100)
	for _, l := range leaves {
		if err := grown.Verify(l.Index, l.Digest); err != nil {
			t.Fatalf("leaf %d in the grown tree: %v", l.Index, err)
		}
	}
	if err := grown.Verify(128*128*2+5, Digest{}); err != nil {
		t.Fatalf("new leaf in the grown tree: %v", err)
	}
	defer func() {
		if recover() == nil {
			t.Error("NewFixedGeometry accepted more leaves than its levels hold")
		}
	}()
	NewFixedGeometry(128*128+1, 2)
}

// TestPathKeys: pathKeys gives every node on the leaves' paths and the top, each once,
// bottom up and in index order within a level, for leaves in any order and with
// repeats, against the paths walked one leaf at a time; with no leaves, the top alone.
// A reused buffer's old contents do not leak into the answer.
func TestPathKeys(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	var buf []nodeKey
	for _, g := range []Geometry{NewGeometry(1), NewGeometry(Arity + 1), NewGeometry(Arity*Arity*3 + 5), NewFixedGeometry(1000, 7)} {
		for trial := range 50 {
			leaves := make([]Leaf, rng.IntN(40))
			for i := range leaves {
				leaves[i].Index = rng.Uint64N(g.Width(0))
			}
			if trial%2 == 0 {
				slices.SortFunc(leaves, func(a, b Leaf) int { return cmp.Compare(a.Index, b.Index) })
			}
			want := map[nodeKey]bool{{g.Levels(), 0}: true}
			for _, l := range leaves {
				for k := (nodeKey{1, l.Index / Arity}); k.level <= g.Levels(); k = (nodeKey{k.level + 1, k.index / Arity}) {
					want[k] = true
				}
			}
			got, err := pathKeys(buf, g, leaves)
			if err != nil {
				t.Fatal(err)
			}
			buf = got
			if len(got) != len(want) {
				t.Fatalf("%d levels, %d leaves: %d keys, want %d", g.Levels(), len(leaves), len(got), len(want))
			}
			for i, k := range got {
				if !want[k] {
					t.Fatalf("key %v is on no leaf's path", k)
				}
				if i > 0 && compareKeys(got[i-1], k) >= 0 {
					t.Fatalf("keys %v then %v: not bottom up in index order, or repeated", got[i-1], k)
				}
			}
		}
	}
	if _, err := pathKeys(nil, NewGeometry(10), []Leaf{{Index: 10}}); err == nil {
		t.Error("a leaf past the width was taken")
	}
}

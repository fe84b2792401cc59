package blockdev

import (
	"fmt"
	"math/bits"
	"sync"

	"github.com/elidisk/eli/blockdev/internal/tree"
	"github.com/elidisk/eli/layout"
)

// metaCache keeps metadata blocks in memory, bounded by a number of blocks, least recently
// used first out. It is write-through: a commit writes a block to the provider from
// the cached copy, so every entry is clean except while a commit has it pinned, and only
// unpinned clean entries are evicted. Memory therefore depends on the bound, never on the
// provider's size. A commit that fails leaves its round's blocks patched and unwritten:
// they stay (at most a round's, half the bound), since the provider holds an older
// version of each, which in version 2 the tree, holding their new digests, refuses.
//
// Who changes a block: only the commit under way (patch, under mu; commits run one at a
// time), for sectors of its batch; readers take records of sectors in no batch (records, under mu). Loads
// of one group are single-flight, and a commit pins a block before it writes it, so a
// load can never race with a write of the same block and cache a stale copy.
type metaCache struct {
	mu      sync.Mutex
	blocks  map[uint64]*mblock
	lru     mblock // sentinel: lru.next is the most recent, lru.prev the least
	n, max  int
	size    int // M
	load    func(g uint64, buf []byte) error
	spare   [][]byte // buffers of evicted blocks, reused by loads
	loads   uint64   // statistics
	evicted uint64

	// Format version 2: each block's piece digests are kept (so that a commit rehashes
	// only the pieces its records touched), and verify checks a block's digest against
	// the hash tree as it enters the cache. A block that fails is not cached.
	hashed bool
	verify func(g uint64, d tree.Digest) error
}

type mblock struct {
	g          uint64
	data       []byte
	pins       int
	loading    chan struct{} // closed when the load finished; nil once loaded
	err        error         // load error, for waiters
	prev, next *mblock
	h          tree.Hasher // piece digests (hashed caches only)
	dirty      [2]uint64   // pieces patched since h last saw them (a block has at most 128)
	// [wlo, whi) holds every byte patched since the block was last written in place
	// (empty: none); outside it the provider holds the block's bytes as they are here.
	wlo, whi int
	// writes counts the block's writes in place since it was loaded (up to
	// pwritesBeforeMapping): the first ones go by system call (writeBlock).
	writes int
}

// newMetaCache makes a cache of blocks of blockSize bytes, at most maxBytes of them, that
// loads a block with load. With verify, it keeps each block's piece digests and checks a
// block's digest with verify as it enters.
func newMetaCache(blockSize int, maxBytes int64, load func(g uint64, buf []byte) error, verify func(g uint64, d tree.Digest) error) *metaCache {
	c := &metaCache{
		blocks: make(map[uint64]*mblock),
		max:    int(max(1, maxBytes/int64(blockSize))),
		size:   blockSize,
		load:   load,
		hashed: verify != nil,
		verify: verify,
	}
	c.lru.next, c.lru.prev = &c.lru, &c.lru
	return c
}

func (c *metaCache) unlink(b *mblock) { b.prev.next, b.next.prev = b.next, b.prev }

func (c *metaCache) pushFront(b *mblock) {
	b.prev, b.next = &c.lru, c.lru.next
	b.prev.next, b.next.prev = b, b
}

// get returns group g's block, loaded and pinned. Callers hold no lock; they unpin it
// when done. A pinned block's data may be read without mu (only its pinner patches it).
func (c *metaCache) get(g uint64) (*mblock, error) {
	c.mu.Lock()
	for {
		b, ok := c.blocks[g]
		if !ok {
			break
		}
		if b.loading == nil {
			b.pins++
			c.unlink(b)
			c.pushFront(b)
			c.mu.Unlock()
			return b, nil
		}
		ch := b.loading
		c.mu.Unlock()
		<-ch
		c.mu.Lock()
		if b.err != nil {
			err := b.err
			c.mu.Unlock()
			return nil, err
		}
	}
	b := &mblock{g: g, loading: make(chan struct{})}
	if n := len(c.spare); n > 0 {
		b.data, c.spare = c.spare[n-1], c.spare[:n-1]
	} else {
		b.data = make([]byte, c.size)
	}
	c.blocks[g] = b
	c.n++
	c.loads++
	c.mu.Unlock()

	err := c.load(g, b.data)
	if err == nil && c.hashed {
		b.h.Reset(b.data)
		err = c.verify(g, b.h.Digest(0, g))
	}

	c.mu.Lock()
	ch := b.loading
	b.loading = nil
	if err != nil {
		b.err = fmt.Errorf("metadata block of group %d: %w", g, err)
		delete(c.blocks, g)
		c.n--
		c.mu.Unlock()
		close(ch)
		return nil, b.err
	}
	b.pins++
	c.pushFront(b)
	c.evictLocked()
	c.mu.Unlock()
	close(ch)
	return b, nil
}

func (c *metaCache) unpin(b *mblock) {
	c.mu.Lock()
	b.pins--
	c.evictLocked()
	c.mu.Unlock()
}

func (c *metaCache) evictLocked() {
	for b := c.lru.prev; c.n > c.max && b != &c.lru; {
		prev := b.prev
		if b.pins == 0 && b.whi == 0 {
			c.unlink(b)
			delete(c.blocks, b.g)
			c.n--
			c.evicted++
			if len(c.spare) < 16 {
				c.spare = append(c.spare, b.data)
			}
			b.data = nil
		}
		b = prev
	}
}

// records copies the records at positions [j, j+len(dst)/layout.RecordSize) of group g.
func (c *metaCache) records(g uint64, j int, dst []byte) error {
	// A cached block, what nearly every read finds: one turn of the lock, no pin.
	c.mu.Lock()
	if b, ok := c.blocks[g]; ok && b.loading == nil {
		copy(dst, b.data[j*layout.RecordSize:])
		c.unlink(b)
		c.pushFront(b)
		c.mu.Unlock()
		return nil
	}
	c.mu.Unlock()
	b, err := c.get(g)
	if err != nil {
		return err
	}
	c.mu.Lock()
	copy(dst, b.data[j*layout.RecordSize:])
	b.pins--
	c.evictLocked()
	c.mu.Unlock()
	return nil
}

// patch sets the record at position j of a block the caller has pinned.
func (c *metaCache) patch(b *mblock, j int, r *record) {
	c.mu.Lock()
	off := j * layout.RecordSize
	copy(b.data[off:], r[:])
	if b.whi == 0 {
		b.wlo, b.whi = off, off+layout.RecordSize
	} else {
		b.wlo, b.whi = min(b.wlo, off), max(b.whi, off+layout.RecordSize)
	}
	if c.hashed {
		// Rehashed once per round by digest, not once per record: a sequential write
		// patches every record of a block.
		for p := off / tree.PieceSize; p <= (off+layout.RecordSize-1)/tree.PieceSize; p++ {
			b.dirty[p/64] |= 1 << (p % 64)
		}
	}
	c.mu.Unlock()
}

// digest is the digest of a block the caller has pinned (hashed caches only). It takes no
// lock: only the commit under way patches blocks, and it calls digest after its patches, so the
// block's bytes and dirty bits hold still meanwhile; readers only read them. Digests of
// different blocks may be computed in parallel.
func (c *metaCache) digest(b *mblock) tree.Digest {
	for w := range b.dirty {
		for m := b.dirty[w]; m != 0; m &= m - 1 {
			p := w*64 + bits.TrailingZeros64(m)
			b.h.Update(b.data, p*tree.PieceSize, tree.PieceSize)
		}
		b.dirty[w] = 0
	}
	return b.h.Digest(0, b.g)
}

// leaves are the digests of blocks the caller has pinned (hashed caches only), of those
// of the groups in only if it is not nil, for the tree.
func (c *metaCache) leaves(blocks []*mblock, only map[uint64]bool) []tree.Leaf {
	var l []tree.Leaf
	for _, b := range blocks {
		if only == nil || only[b.g] {
			l = append(l, tree.Leaf{Index: b.g, Digest: c.digest(b)})
		}
	}
	return l
}

// record reads position j of a block the caller has pinned.
func (c *metaCache) record(b *mblock, j int) (r record) {
	c.mu.Lock()
	copy(r[:], b.data[j*layout.RecordSize:])
	c.mu.Unlock()
	return r
}

// capacity is the bound in blocks.
func (c *metaCache) capacity() int { return c.max }

// stats reports the number of blocks held, loads and evictions so far.
func (c *metaCache) stats() (held int, loads, evicted uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n, c.loads, c.evicted
}

package blockdev

import (
	"sync"

	"github.com/elidisk/eli/blockdev/internal/tree"
)

// maxConcurrentIO bounds the writes one commit step has on the wire at once over a
// provider shared by hosts.
const maxConcurrentIO = 64

// concurrentIO reports whether a commit step issues its writes all at once rather than
// through the CPU-bound workers: over a network provider (provider.Capabilities.Shared:
// an NBD export) each write is a round trip, which costs latency, not CPU, and the
// provider pipelines concurrent calls; one worker per CPU would wait out the round
// trips one after another (docs/benchmarks.md, "Remote providers").
func (c *core) concurrentIO() bool { return c.caps.Shared && !c.caps.SerialWrites }

// eachConcurrently runs fn(0..n-1) with up to maxConcurrentIO running at once and
// returns the first error.
func eachConcurrently(n int, fn func(i int) error) error {
	if n == 1 {
		return fn(0)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		sem   = make(chan struct{}, maxConcurrentIO)
	)
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := fn(i); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return first
}

// prefetch loads the metadata blocks of a round's groups that the cache lacks, all at
// once, so that commitRound's loads in order find them there instead of taking a round
// trip each. A failed load is left for commitRound's own to report.
func (c *committer) prefetch(refs []ref) {
	var groups []uint64
	for _, r := range refs {
		if g, _ := c.geo.groupOf(r.i); len(groups) == 0 || groups[len(groups)-1] != g {
			groups = append(groups, g)
		}
	}
	if len(groups) < 2 {
		return
	}
	eachConcurrently(len(groups), func(k int) error {
		if blk, err := c.cache.get(groups[k]); err == nil {
			c.cache.unpin(blk)
		}
		return nil
	})
}

// writeInPlace is step 2 of a commit round over a network provider: the data, the
// metadata blocks and the tree nodes go out together (their order does not matter:
// recovery sorts out a crash in between), one round trip instead of three, then the sync.
func (c *committer) writeInPlace(written []ref, blocks []*mblock, tc *tree.Commit) error {
	var derr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		derr = c.writeData(written)
	}()
	var nerr error
	nodesDone := make(chan struct{})
	go func() {
		defer close(nodesDone)
		nerr = c.writeNodes([]*tree.Commit{tc})
	}()
	berr := eachConcurrently(len(blocks), func(k int) error { return c.writeBlock(blocks[k]) })
	<-done
	<-nodesDone
	if nerr != nil {
		return nerr
	}
	if derr != nil {
		return derr
	}
	if berr != nil {
		return berr
	}
	return c.timedSync()
}

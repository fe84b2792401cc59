package blockdev

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// TestSectorMapModel puts runs and single sectors, some rewriting earlier ones, into a
// sectorMap and a Go map side by side, and checks lookups, the count, the sorted walk and
// that reset gives back exactly the slab references the entries held.
func TestSectorMapModel(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 9))
	pool := newSlabPool(512, 64, 1<<20)
	var m sectorMap
	for round := range 3 { // reset in between: spans are reused
		model := map[uint64]entry{}
		var slabs []*slab
		for range 300 {
			n := 1 + r.IntN(40)
			if r.IntN(3) == 0 {
				n = 1
			}
			first := r.Uint64N(2000)
			if r.IntN(4) == 0 {
				first = r.Uint64() >> 4 // far apart: spans of their own
			}
			sl := pool.get(n)
			slabs = append(slabs, sl)
			sl.refs.Add(int32(n))
			for k := range n {
				i := first + uint64(k)
				e := entry{slab: sl, off: int32(k * 512), rec: record{byte(round), byte(k), byte(n)}}
				old, replaced := m.put(i, e)
				if prev, ok := model[i]; ok != replaced || (ok && old != prev) {
					t.Fatalf("put %d: replaced %v %+v, model %v %+v", i, replaced, old, ok, prev)
				}
				if replaced {
					pool.release(old.slab)
				}
				model[i] = e
			}
			pool.release(sl) // the entries hold their own references
		}
		if m.len() != len(model) {
			t.Fatalf("len %d, model %d", m.len(), len(model))
		}
		for i, want := range model {
			if e, ok := m.get(i); !ok || *e != want {
				t.Fatalf("get %d: %v %+v, want %+v", i, ok, e, want)
			}
			if _, ok := m.get(i + 1<<40); ok {
				t.Fatalf("get %d: found a sector never put", i+1<<40)
			}
		}
		refs := m.appendSorted(nil)
		want := make([]uint64, 0, len(model))
		for i := range model {
			want = append(want, i)
		}
		slices.Sort(want)
		if len(refs) != len(want) {
			t.Fatalf("sorted walk: %d sectors, want %d", len(refs), len(want))
		}
		for k, rf := range refs {
			if rf.i != want[k] || *rf.e != model[rf.i] {
				t.Fatalf("sorted walk: position %d is sector %d %+v, want %d %+v", k, rf.i, *rf.e, want[k], model[want[k]])
			}
		}
		m.reset(pool)
		if m.len() != 0 || len(m.appendSorted(nil)) != 0 {
			t.Fatal("reset left entries")
		}
		if _, ok := m.get(want[0]); ok {
			t.Fatal("reset left a sector visible")
		}
		for _, sl := range slabs {
			if n := sl.refs.Load(); n != 0 {
				t.Fatalf("after reset a slab holds %d references, want 0", n)
			}
		}
		if len(m.free) == 0 {
			t.Fatal("reset kept no span for reuse")
		}
	}
}

// TestScatteredTrimsBounded: one-sector trims far apart each take a span of the batch's
// index, which is counted against MaxBatchBytes, so that a batch of them still commits in
// bounded pieces.
func TestScatteredTrimsBounded(t *testing.T) {
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 1<<16)
	v.cfg.CommitInterval = time.Hour
	d := v.open(t)
	defer d.Close()
	a := authOf(d)
	const trims = 3000
	for k := range trims {
		if err := d.Trim(int64(k)*spanSectors*512, 512, 0); err != nil {
			t.Fatal(err)
		}
		a.batches.mu.Lock()
		b := a.batches.pending
		bytes, n := b.cost(), b.entries.len()
		a.batches.mu.Unlock()
		if want := int64(n) * (zeroEntryCost + spanCost); bytes != want {
			t.Fatalf("after %d trims the pending batch counts %d bytes for %d entries, want %d", k+1, bytes, n, want)
		}
		if bytes > a.batches.maxBatch+spanCost {
			t.Fatalf("pending batch at %d bytes, bound %d", bytes, a.batches.maxBatch)
		}
	}
	if st := d.Stats(); uint64(trims)*uint64(zeroEntryCost+spanCost) > uint64(a.batches.maxBatch)*3/2 && st.Commits == 0 {
		t.Fatalf("%d scattered trims made no commit, with batches of %d bytes", trims, a.batches.maxBatch)
	}
}

// heldSync is a provider whose syncs wait while mu is held: commits stall.
type heldSync struct {
	*memProvider
	mu *sync.Mutex
}

func (p heldSync) Sync() error { p.mu.Lock(); p.mu.Unlock(); return nil }

// TestFullBatchesRecycleSlabs: when a full batch waits for a full batch that is
// committing, and both then commit, every slab goes back to the pool and later such loads
// make no new one. (A pool that kept one batch's worth would drop the rest, and a
// sequential load would fault in, zero and collect new slabs: docs/benchmarks.md.)
func TestFullBatchesRecycleSlabs(t *testing.T) {
	const sectors = 1 << 16 // 32 MiB of 512-byte sectors
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, sectors)
	v.cfg.MaxBatchBytes = 8 << 20
	v.cfg.CommitBytes = 4 << 20
	var held sync.Mutex
	d, err := Open(heldSync{v.mem, &held}, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	a := authOf(d)
	const writers, req = 4, 1 << 20 // one slab each
	if req != d.pieceSectors*d.s {
		t.Fatalf("requests of %d bytes, slabs of %d", req, d.pieceSectors*d.s)
	}
	load := func(base int64) {
		held.Lock()
		var wg sync.WaitGroup
		for w := range writers {
			wg.Go(func() {
				buf := bytes.Repeat([]byte{byte(w)}, req)
				for k := int64(w); k < 24; k += writers { // more than two batches
					if err := d.WriteAt(buf, (base+k)*req%(sectors*512), 0); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		// Wait until a writer waits for room while a batch commits: two batches full.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			a.batches.mu.Lock()
			full := a.batches.blocked > 0 && a.batches.committing != nil
			a.batches.mu.Unlock()
			if full {
				break
			}
			if time.Now().After(deadline) {
				held.Unlock()
				t.Fatal("no writer waits for room after 10 s")
			}
		}
		held.Unlock()
		wg.Wait()
		if err := d.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	// Writers reserve room before they take a slab, so two batches' worth is the most in
	// use at once, and the pool keeps as many idle (and two spare).
	bound := uint64(2*a.batches.maxBatch/req + 2)
	for k := range 4 {
		load(int64(k) * 24)
		made := a.batches.slabs.allocs.Load()
		a.batches.slabs.mu.Lock()
		idle := a.batches.slabs.freeBytes / req
		a.batches.slabs.mu.Unlock()
		if idle != int64(made) {
			t.Fatalf("after %d loads, all committed: %d slabs made, %d idle in the pool; it dropped the rest", k+1, made, idle)
		}
		if made > bound {
			t.Fatalf("after %d loads %d slabs made, more than two batches' worth (%d)", k+1, made, bound)
		}
	}
}

// slowSync is a provider whose syncs take delay, like a disk's cache flush.
type slowSync struct {
	*memProvider
	delay time.Duration
}

func (p slowSync) Sync() error { time.Sleep(p.delay); return nil }

// TestBatchLimitFollowsSyncCost: batches may grow to MaxBatchBytes where syncs are slow
// (they amortize them) and stay at four times CommitBytes where syncs are free (they
// stay in cache).
func TestBatchLimitFollowsSyncCost(t *testing.T) {
	for _, tc := range []struct {
		name  string
		delay time.Duration
		want  func(a *authEngine) int64
	}{
		{"free syncs", 0, func(a *authEngine) int64 { return a.batches.batchFloor }},
		{"5 ms syncs", 5 * time.Millisecond, func(a *authEngine) int64 { return a.batches.maxBatch }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 1<<12) // 16 MiB
			v.cfg.MaxBatchBytes = 8 << 20
			v.cfg.CommitBytes = 512 << 10
			var p provider.Provider = v.mem
			if tc.delay > 0 {
				p = slowSync{v.mem, tc.delay}
			}
			d, err := Open(p, v.cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			a := authOf(d)
			if a.batches.batchFloor != 2<<20 {
				t.Fatalf("batch floor %d, want 4·CommitBytes", a.batches.batchFloor)
			}
			buf := bytes.Repeat([]byte{7}, 1<<20)
			for k := range 32 {
				if err := d.WriteAt(buf, int64(k%16)<<20, 0); err != nil {
					t.Fatal(err)
				}
			}
			if err := d.Flush(); err != nil {
				t.Fatal(err)
			}
			a.batches.mu.Lock()
			limit := a.batches.limit
			a.batches.mu.Unlock()
			if want := tc.want(a); limit != want {
				t.Fatalf("batch limit %d after a commit, want %d", limit, want)
			}
		})
	}
}

// TestLargeTrimAmidWrites: a trim far larger than a batch goes through in pieces while
// other clients keep writing. Each piece must fit the batch bound at its smallest
// (4·CommitBytes, where syncs are free), or it would wait for a moment with nothing
// pending and nothing reserved, which steady writers may never leave.
func TestLargeTrimAmidWrites(t *testing.T) {
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 1<<17) // 64 MiB of 512-byte sectors
	d := v.open(t)
	defer d.Close()
	if err := d.Flush(); err != nil { // a commit, so that the bound has adapted
		t.Fatal(err)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			buf := bytes.Repeat([]byte{byte(w + 1)}, 1<<20)
			for k := 0; !stop.Load(); k++ {
				if err := d.WriteAt(buf, int64(w*8+k%8)<<20, 0); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	done := make(chan error, 1)
	go func() { done <- d.Trim(32<<20, 32<<20, 0) }()
	select {
	case err := <-done:
		if err != nil {
			t.Error(err)
		}
	case <-time.After(20 * time.Second):
		t.Error("a 32 MiB trim did not get through 20 s of steady writes")
		stop.Store(true)
		<-done
	}
	stop.Store(true)
	wg.Wait()
}

// BenchmarkSectorMap: a batch's bookkeeping per 4 KiB write, a put and its share of the
// commit's sorted walk and reset, for a batch of 256 lone writes (a commit's worth at
// queue depth 32) at random sectors of a 1 GiB volume, and for 256 consecutive ones.
// Each entry holds a kept slab of its own, as an NBD write's does.
func BenchmarkSectorMap(b *testing.B) {
	const n = 256
	for _, layout := range []string{"random", "sequential"} {
		b.Run(layout, func(b *testing.B) {
			r := rand.New(rand.NewPCG(1, 2))
			pool := newSlabPool(4096, 64, 1<<20)
			var m sectorMap
			var refs []ref
			slabs := make([]slab, n)
			idx := make([]uint64, n)
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				k := i % n
				if layout == "random" {
					idx[k] = r.Uint64N(1 << 18)
				} else {
					idx[k] = uint64(i)
				}
				sl := &slabs[k]
				sl.refs.Store(1)
				sl.kept = func() {}
				m.put(idx[k], entry{slab: sl})
				if k == n-1 {
					refs = m.appendSorted(refs[:0])
					m.reset(pool)
				}
			}
		})
	}
}

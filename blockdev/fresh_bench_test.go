package blockdev

import (
	crand "crypto/rand"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/cputime"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// BenchmarkFormatVersions runs format versions 1 and 2 side by side on the same machine,
// in one run, on a 1 GiB tmpfs file with 4 KiB sectors:
//
//	go test -run '^$' -bench FormatVersions -count 5 ./blockdev/
//
// seq-write and seq-read: 1 MiB requests, four in flight, over the whole volume (a Flush
// per 128 MiB); rand-write: 4 KiB at random offsets, 32 in flight, a Flush per 64 writes
// per client; queued-write: the same into a written volume with no Flush, each buffer
// handed over with WriteKeep as the NBD server does (fio's random writes at queue depth
// 32, bench/randio.sh, without the protocol); rand-read: 4 KiB at random offsets, 32 in
// flight, after the volume was written (so reads open sectors and the metadata spans more
// groups than the cache holds with a 4 MiB cache, and blocks are verified against the
// tree as they enter it). cpu-ns/op is the process's CPU time per op, steadier than wall
// time on a shared machine.
func BenchmarkFormatVersions(b *testing.B) {
	const volSize = 1 << 30
	for _, work := range []string{"seq-write", "seq-read", "rand-write", "queued-write", "rand-read"} {
		for _, v := range []uint32{1, 2} {
			b.Run(fmt.Sprintf("%s/v%d", work, v), func(b *testing.B) {
				version := v
				if v == 1 {
					version = 0
				}
				cfg := Config{}
				if work == "rand-read" {
					cfg.CacheBytes = 4 << 20
				}
				d := benchDeviceVersion(b, benchDir(b), volSize, version, cfg)
				defer d.Close()
				benchVersionWork(b, d, work)
			})
		}
	}
}

func benchVersionWork(b *testing.B, d *Device, work string) {
	const req = 1 << 20
	big := make([]byte, req)
	crand.Read(big)
	n := d.Size() / req
	if work != "seq-write" && work != "rand-write" {
		// Reads open written sectors; queued writes replace written ones, as on a
		// provider that holds data (on tmpfs, a write into a hole allocates a page).
		for k := range n {
			if err := d.WriteAt(big, k*req, 0); err != nil {
				b.Fatal(err)
			}
		}
		if err := d.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	sectors := d.Size() / 4096
	run := func(clients int, op func(c int, i int64) error) {
		var next atomic.Int64
		var wg sync.WaitGroup
		for c := range clients {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= int64(b.N) {
						return
					}
					if err := op(c, i); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	b.ResetTimer()
	start, cpu := time.Now(), cputime.Process()
	switch work {
	case "seq-write", "seq-read":
		b.SetBytes(req)
		bufs := make([][]byte, 4)
		for q := range bufs {
			bufs[q] = make([]byte, req)
			copy(bufs[q], big)
		}
		run(4, func(c int, i int64) error {
			off := i % n * req
			if work == "seq-read" {
				return d.ReadAt(bufs[c], off)
			}
			if err := d.WriteAt(bufs[c], off, 0); err != nil {
				return err
			}
			if i%128 == 127 {
				return d.Flush()
			}
			return nil
		})
		if work == "seq-write" {
			if err := d.Flush(); err != nil {
				b.Fatal(err)
			}
		}
	default:
		b.SetBytes(4096)
		const clients = 32
		bufs := make([][]byte, clients)
		rngs := make([]*rand.Rand, clients)
		counts := make([]int, clients)
		for c := range bufs {
			bufs[c] = make([]byte, 4096)
			rngs[c] = rand.New(rand.NewPCG(uint64(c), 7))
		}
		// queued-write's buffers go back to the pool when the batch lets go of them, as
		// the server's do.
		pool := sync.Pool{New: func() any { return make([]byte, 4096) }}
		run(clients, func(c int, _ int64) error {
			off := rngs[c].Int64N(sectors) * 4096
			switch work {
			case "rand-read":
				return d.ReadAt(bufs[c], off)
			case "queued-write":
				buf := pool.Get().([]byte)
				buf[0] = byte(c)
				return d.WriteKeep(buf, off, 0, func() { pool.Put(buf) })
			}
			if err := d.WriteAt(bufs[c], off, 0); err != nil {
				return err
			}
			if counts[c]++; counts[c]%64 == 0 {
				return d.Flush()
			}
			return nil
		})
		if work == "queued-write" {
			if err := d.Flush(); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	if work != "seq-write" && work != "seq-read" {
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "IOPS")
	}
	if c := cputime.Process() - cpu; c > 0 {
		b.ReportMetric(float64(c.Nanoseconds())/float64(b.N), "cpu-ns/op")
	}
}

// sparseMem is a provider of any size in memory that holds only the 4 KiB pages written
// to it: for volumes of terabytes whose attach cost and memory are measured.
type sparseMem struct {
	mu    sync.RWMutex
	size  int64
	pages map[int64]*[4096]byte
	reads atomic.Int64 // bytes read
}

func newSparseMem(size int64) *sparseMem {
	return &sparseMem{size: size, pages: make(map[int64]*[4096]byte)}
}

func (m *sparseMem) Size() int64 { return m.size }
func (m *sparseMem) Sync() error { return nil }

func (m *sparseMem) ReadAt(b []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(b)) > m.size {
		return 0, fmt.Errorf("sparseMem: read outside")
	}
	m.reads.Add(int64(len(b)))
	m.mu.RLock()
	defer m.mu.RUnlock()
	for done := 0; done < len(b); {
		pos := off + int64(done)
		pg, in := pos/4096, int(pos%4096)
		n := min(len(b)-done, 4096-in)
		if p := m.pages[pg]; p != nil {
			copy(b[done:done+n], p[in:])
		} else {
			clear(b[done : done+n])
		}
		done += n
	}
	return len(b), nil
}

func (m *sparseMem) WriteAt(b []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(b)) > m.size {
		return 0, fmt.Errorf("sparseMem: write outside")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for done := 0; done < len(b); {
		pos := off + int64(done)
		pg, in := pos/4096, int(pos%4096)
		n := min(len(b)-done, 4096-in)
		p := m.pages[pg]
		if p == nil {
			p = new([4096]byte)
			m.pages[pg] = p
		}
		copy(p[in:], b[done:done+n])
		done += n
	}
	return len(b), nil
}

func (m *sparseMem) Capabilities() provider.Capabilities {
	return provider.Capabilities{Punch: m.Punch}
}

// Punch zeroes; on an empty map (Format of a new volume) it costs nothing.
func (m *sparseMem) Punch(off, n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for pg, p := range m.pages {
		lo, hi := max(off, pg*4096), min(off+n, pg*4096+4096)
		if lo < hi {
			clear(p[lo-pg*4096 : hi-pg*4096])
		}
	}
	return nil
}

// sparseVolume formats a sparse provider of size bytes in version, writes a few scattered
// sectors, closes it, and returns the provider and the config to open it.
func sparseVolume(tb testing.TB, size int64, version uint32) (*sparseMem, Config) {
	tb.Helper()
	p := newSparseMem(size)
	l, err := layout.PlanVersion(version, size, 4096, sector.ModeXChaCha20Poly1305, 0)
	if err != nil {
		tb.Fatal(err)
	}
	if err := Format(p, l); err != nil {
		tb.Fatal(err)
	}
	cfg := Config{Layout: l, Codec: newCodec(tb, sector.ModeXChaCha20Poly1305, 4096, testVolumeID),
		JournalKey: testJournalKey, Logger: discardLogger()}
	d, err := Open(p, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	buf := make([]byte, 4096)
	for k := range int64(64) {
		if err := d.WriteAt(buf, (d.Size()/4096/64*k)*4096, 0); err != nil {
			tb.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		tb.Fatal(err)
	}
	return p, cfg
}

// TestOpenCostIndependentOfSize: attaching a version 2 volume reads the same bytes at
// 1 TiB as at 16 TiB (the journal's slots and the tree's top node), so attach time cannot
// grow with the volume. Counted, not timed.
func TestOpenCostIndependentOfSize(t *testing.T) {
	t.Parallel()
	var reads []int64
	for _, size := range []int64{1 << 40, 16 << 40} {
		p, cfg := sparseVolume(t, size, layout.Version2)
		p.reads.Store(0)
		d, err := Open(p, cfg)
		if err != nil {
			t.Fatal(err)
		}
		reads = append(reads, p.reads.Load())
		d.Close()
	}
	if reads[0] != reads[1] || reads[0] > 2*layout.DefaultJournalLen {
		t.Fatalf("Open read %d bytes at 1 TiB and %d at 16 TiB", reads[0], reads[1])
	}
}

// BenchmarkOpen16T: Open of sparse 1 TiB and 16 TiB volumes in both versions, and the
// heap a 16 TiB version 2 device holds after 20000 random 4 KiB writes and reads across
// it (device-heap-MiB: the heap in use less the sparse provider's own pages).
func BenchmarkOpen16T(b *testing.B) {
	for _, size := range []int64{1 << 40, 16 << 40} {
		for _, v := range []uint32{0, layout.Version2} {
			b.Run(fmt.Sprintf("%dTiB/v%d", size>>40, max(1, v)), func(b *testing.B) {
				p, cfg := sparseVolume(b, size, v)
				for b.Loop() {
					d, err := Open(p, cfg)
					if err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					d.Close()
					b.StartTimer()
				}
			})
		}
	}
	b.Run("16TiB/v2/heap", func(b *testing.B) {
		for b.Loop() {
			p, cfg := sparseVolume(b, 16<<40, layout.Version2)
			d, err := Open(p, cfg)
			if err != nil {
				b.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(3, 4))
			buf := make([]byte, 4096)
			sectors := d.Size() / 4096
			for k := range 20000 {
				off := rng.Int64N(sectors) * 4096
				if err := d.WriteAt(buf, off, 0); err != nil {
					b.Fatal(err)
				}
				if k%64 == 63 {
					if err := d.Flush(); err != nil {
						b.Fatal(err)
					}
				}
			}
			for range 20000 {
				if err := d.ReadAt(buf, rng.Int64N(sectors)*4096); err != nil {
					b.Fatal(err)
				}
			}
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			p.mu.RLock()
			provBytes := int64(len(p.pages)) * (4096 + 64)
			p.mu.RUnlock()
			b.ReportMetric(float64(int64(ms.HeapInuse)-provBytes)/(1<<20), "device-heap-MiB")
			b.ReportMetric(float64(d.Stats().CacheBlocks), "cache-blocks")
			d.Close()
		}
	})
}

// BenchmarkVersionsAlternating is BenchmarkFormatVersions with both devices open at once
// and driven in alternating bursts (v1, then v2, then v1...), so that a change of load on
// a shared machine hits both sides of the ratio alike. One op is a burst of each:
// 64 MiB sequential, or 8192 random 4 KiB requests. rand-read-misses is rand-read with a
// 4 MiB metadata cache. Metrics: v1 and v2 throughput and
// v2/v1, the ratio the issue bounds (sequential within 10%, random write within 15%,
// random read within 10%).
func BenchmarkVersionsAlternating(b *testing.B) {
	const volSize = 1 << 30
	for _, work := range []string{"seq-write", "seq-read", "rand-write", "sync-write", "rand-read", "rand-read-misses"} {
		b.Run(work, func(b *testing.B) {
			cfg := Config{}
			if work == "rand-read-misses" {
				// A metadata cache of a sixth of the volume's blocks: most reads load
				// (and in v2 verify) a block, as on a volume far larger than the cache.
				cfg.CacheBytes = 4 << 20
				work = "rand-read"
			}
			var runs [2]func() (time.Duration, int64)
			for k, version := range []uint32{0, layout.Version2} {
				d := benchDeviceVersion(b, benchDir(b), volSize, version, cfg)
				defer d.Close()
				runs[k] = versionBurst(b, d, work)
			}
			var took [2]time.Duration
			var done [2]int64
			for b.Loop() {
				for k := range runs {
					t, n := runs[k]()
					took[k] += t
					done[k] += n
				}
			}
			unit, scale := "MB/s", 1e6
			if work == "rand-write" || work == "sync-write" || work == "rand-read" {
				unit, scale = "kIOPS", 4096*1e3
			}
			v1 := float64(done[0]) / took[0].Seconds() / scale
			v2 := float64(done[1]) / took[1].Seconds() / scale
			b.ReportMetric(v1, "v1-"+unit)
			b.ReportMetric(v2, "v2-"+unit)
			b.ReportMetric(v2/v1, "v2/v1")
		})
	}
}

// versionBurst prepares d for work and returns a function that runs one burst and
// reports its time and bytes.
func versionBurst(b *testing.B, d *Device, work string) func() (time.Duration, int64) {
	const req = 1 << 20
	big := make([]byte, req)
	crand.Read(big)
	n := d.Size() / req
	if work == "seq-read" || work == "rand-read" {
		for k := range n {
			if err := d.WriteAt(big, k*req, 0); err != nil {
				b.Fatal(err)
			}
		}
		if err := d.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	sectors := d.Size() / 4096
	var pos atomic.Int64
	parallel := func(clients int, count int64, op func(c int, i int64) error) {
		var next atomic.Int64
		var wg sync.WaitGroup
		for c := range clients {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= count {
						return
					}
					if err := op(c, i); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	if work == "seq-write" || work == "seq-read" {
		bufs := make([][]byte, 4)
		for q := range bufs {
			bufs[q] = append([]byte(nil), big...)
		}
		return func() (time.Duration, int64) {
			const count = 64
			base := pos.Add(count) - count
			start := time.Now()
			parallel(4, count, func(c int, i int64) error {
				off := (base + i) % n * req
				if work == "seq-read" {
					return d.ReadAt(bufs[c], off)
				}
				return d.WriteAt(bufs[c], off, 0)
			})
			if work == "seq-write" {
				if err := d.Flush(); err != nil {
					b.Fatal(err)
				}
			}
			return time.Since(start), count * req
		}
	}
	if work == "sync-write" {
		// One client that flushes after every 4 KiB write, as a database's fsync does:
		// the flush's syncs are all of the cost.
		buf := make([]byte, 4096)
		rng := rand.New(rand.NewPCG(1, 7))
		return func() (time.Duration, int64) {
			const count = 256
			start := time.Now()
			for range count {
				if err := d.WriteAt(buf, rng.Int64N(sectors)*4096, 0); err != nil {
					b.Fatal(err)
				}
				if err := d.Flush(); err != nil {
					b.Fatal(err)
				}
			}
			return time.Since(start), count * 4096
		}
	}
	const clients = 32
	bufs := make([][]byte, clients)
	rngs := make([]*rand.Rand, clients)
	for c := range bufs {
		bufs[c] = make([]byte, 4096)
		rngs[c] = rand.New(rand.NewPCG(uint64(c), 7))
	}
	return func() (time.Duration, int64) {
		const count = 8192
		start := time.Now()
		parallel(clients, count, func(c int, i int64) error {
			off := rngs[c].Int64N(sectors) * 4096
			if work == "rand-read" {
				return d.ReadAt(bufs[c], off)
			}
			if err := d.WriteAt(bufs[c], off, 0); err != nil {
				return err
			}
			if i%64 == 63 {
				return d.Flush()
			}
			return nil
		})
		return time.Since(start), count * 4096
	}
}

package blockdev

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/sector"
)

// The concurrency test (run it with -race). Goroutines write, zero, trim, read and flush
// overlapping ranges, with commits running all the time in the background (1 ms
// interval, a metadata cache of two blocks). Every 8-byte word a write stores names the
// write and the word, so any value read back says exactly which operation it came from.
// The checker then demands, for every word of every read and of the final state:
//
//   - the value comes from an operation covering that word that began before the read
//     ended (or is zero and comes from the initial state or a zeroing operation);
//   - no other operation covering the word both started after that one ended and ended
//     before the read began (that would be a lost update, or a stale read).
//
// Writes are 8-byte aligned but not sector aligned, so many are read-modify-write of
// sectors shared with concurrent writers: a lost update between them shows up as an old
// word in the final state.

type ccOp struct {
	id         uint32 // 0: the initial state
	zero       bool   // the op stores zeroes (write-zeroes, trim)
	start, end int64
	lo, hi     int // words [lo, hi)
}

type ccRead struct {
	start, end int64
	lo         int
	vals       []uint64
}

func ccWord(id uint32, w int) uint64 { return uint64(id)<<32 | uint64(uint32(w)) }

func TestConcurrentModel(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		sectorSize int
		sectors    uint64
		tmpfs      bool
	}{
		{"512", 512, 420, false},
		{"4096", 4096, 120, false},
		// A file on tmpfs, which the provider reads through a mapping.
		{"4096-tmpfs", 4096, 120, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var v *testVol
			if tc.tmpfs {
				v = newFileVol(t, shmDir(t), sector.ModeXChaCha20Poly1305, tc.sectorSize, tc.sectors)
				if !v.file.Mapped() {
					t.Fatal("the tmpfs volume is not mapped")
				}
			} else {
				v = newTestVol(t, sector.ModeXChaCha20Poly1305, tc.sectorSize, tc.sectors)
			}
			runConcurrentModel(t, v)
		})
	}
}

func runConcurrentModel(t *testing.T, v *testVol) {
	sectorSize := v.l.SectorSize
	v.cfg.CommitInterval = time.Millisecond
	v.cfg.CacheBytes = 2 * 4096
	v.cfg.Logger = discardLogger()
	d := v.open(t)
	words := int(d.Size() / 8)
	sw := sectorSize / 8

	var clock atomic.Int64
	var nextID atomic.Uint32
	const goroutines, opsEach = 8, 250
	opsCh := make(chan []ccOp, goroutines)
	readsCh := make(chan []ccRead, goroutines)
	errCh := make(chan error, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 99))
			var ops []ccOp
			var reads []ccRead
			buf := make([]byte, 6*sectorSize)
			for range opsEach {
				// Ranges cluster in a few sectors so that writers collide often.
				lo := r.IntN(words)
				if r.IntN(2) == 0 {
					lo = (r.IntN(6) * words / 6) + r.IntN(2*sw)
				}
				n := 1 + r.IntN(len(buf)/8)
				if r.IntN(2) == 0 {
					n = 1 + r.IntN(sw)
				}
				lo = min(lo, words-1)
				hi := min(words, lo+n)
				switch k := r.IntN(12); {
				case k < 6:
					id := nextID.Add(1)
					p := buf[:(hi-lo)*8]
					for w := lo; w < hi; w++ {
						binary.LittleEndian.PutUint64(p[(w-lo)*8:], ccWord(id, w))
					}
					op := ccOp{id: id, lo: lo, hi: hi, start: clock.Add(1)}
					fl := Flags(0)
					if r.IntN(8) == 0 {
						fl = FUA
					}
					var err error
					if id%2 == 0 {
						err = d.WriteKeep(bytes.Clone(p), int64(lo)*8, fl, func() {})
					} else {
						err = d.WriteAt(p, int64(lo)*8, fl)
					}
					if err != nil {
						errCh <- err
						return
					}
					op.end = clock.Add(1)
					ops = append(ops, op)
				case k < 7:
					op := ccOp{id: nextID.Add(1), zero: true, lo: lo, hi: hi, start: clock.Add(1)}
					if err := d.WriteZeroes(int64(lo)*8, int64(hi-lo)*8, 0); err != nil {
						errCh <- err
						return
					}
					op.end = clock.Add(1)
					ops = append(ops, op)
				case k < 8:
					// Trim whole sectors only: partial sectors at the edges are left alone.
					slo, shi := (lo+sw-1)/sw*sw, hi/sw*sw
					if shi <= slo {
						continue
					}
					op := ccOp{id: nextID.Add(1), zero: true, lo: slo, hi: shi, start: clock.Add(1)}
					if err := d.Trim(int64(slo)*8, int64(shi-slo)*8, 0); err != nil {
						errCh <- err
						return
					}
					op.end = clock.Add(1)
					ops = append(ops, op)
				case k < 9:
					if err := d.Flush(); err != nil {
						errCh <- err
						return
					}
				default:
					p := buf[:(hi-lo)*8]
					rd := ccRead{lo: lo, start: clock.Add(1)}
					if err := d.ReadAt(p, int64(lo)*8); err != nil {
						errCh <- fmt.Errorf("read words [%d, %d): %w", lo, hi, err)
						return
					}
					rd.end = clock.Add(1)
					rd.vals = make([]uint64, hi-lo)
					for w := range rd.vals {
						rd.vals[w] = binary.LittleEndian.Uint64(p[w*8:])
					}
					reads = append(reads, rd)
				}
			}
			opsCh <- ops
			readsCh <- reads
		})
	}
	wg.Wait()
	close(errCh)
	for err := range errCh {
		t.Fatal(err)
	}
	close(opsCh)
	close(readsCh)

	byID := make([]ccOp, nextID.Load()+1) // ids are dense; ids of skipped ops stay unused
	byID[0] = ccOp{id: 0, zero: true, start: math.MinInt64, end: math.MinInt64, lo: 0, hi: words}
	nops := 0
	cover := make([][]uint32, words) // ops covering each word
	for ops := range opsCh {
		for _, op := range ops {
			nops++
			byID[op.id] = op
			for w := op.lo; w < op.hi; w++ {
				cover[w] = append(cover[w], op.id)
			}
		}
	}
	for w := range cover {
		cover[w] = append(cover[w], 0)
	}
	check := func(w int, val uint64, rs, re int64, what string) {
		t.Helper()
		var cands []ccOp
		if val == 0 {
			for _, id := range cover[w] {
				if byID[id].zero {
					cands = append(cands, byID[id])
				}
			}
		} else {
			id := uint32(val >> 32)
			if int(id) >= len(byID) {
				t.Fatalf("%s: word %d holds %#x, which no write put there", what, w, val)
			}
			op := byID[id]
			if op.id != id || uint32(val) != uint32(w) || op.zero || op.lo > w || w >= op.hi {
				t.Fatalf("%s: word %d holds %#x, which no write put there", what, w, val)
			}
			cands = []ccOp{op}
		}
	next:
		for _, c := range cands {
			if c.start > re {
				continue
			}
			for _, id := range cover[w] {
				o := byID[id]
				if o.id != c.id && c.end < o.start && o.end < rs {
					continue next // o certainly replaced c before the read began
				}
			}
			return
		}
		t.Fatalf("%s: word %d holds %#x: stale or lost (op %d of %d covering it)", what, w, val, len(cands), len(cover[w]))
	}
	nreads := 0
	for reads := range readsCh {
		for _, rd := range reads {
			nreads++
			for k, val := range rd.vals {
				check(rd.lo+k, val, rd.start, rd.end, "concurrent read")
			}
		}
	}

	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if d.Stats().Commits < 10 {
		t.Fatalf("only %d commits: reads did not race with commits", d.Stats().Commits)
	}
	d = v.open(t)
	defer d.Close()
	final := make([]byte, d.Size())
	if err := d.ReadAt(final, 0); err != nil {
		t.Fatal(err)
	}
	for w := range words {
		check(w, binary.LittleEndian.Uint64(final[w*8:]), math.MaxInt64, math.MaxInt64, "final state")
	}
	t.Logf("%d operations, %d reads checked word by word", nops, nreads)
}

// slowReader delays every read of the data area, so that commits start and finish while a
// reader sits between reading a record (from the cache) and reading the data. It also
// pauses after every write there (lingering, when not zero), so that a commit is still
// running when a reader that read its new data without its new record looks again.
type slowReader struct {
	*memProvider
	from      int64
	delay     time.Duration
	lingering time.Duration
}

func (s slowReader) ReadAt(b []byte, off int64) (int, error) {
	if off >= s.from {
		time.Sleep(s.delay)
	}
	return s.memProvider.ReadAt(b, off)
}

func (s slowReader) WriteAt(b []byte, off int64) (int, error) {
	n, err := s.memProvider.WriteAt(b, off)
	if off >= s.from && s.lingering > 0 {
		time.Sleep(s.lingering)
	}
	return n, err
}

// TestReadDuringCommit: readers of sectors that a writer keeps rewriting with FUA (one
// commit each) must always see a matching (data, record) pair: a value that was written,
// never an authentication error. Without the second look of read.go this fails at once.
func TestReadDuringCommit(t *testing.T) {
	t.Parallel()
	// Fast commits mostly finish during a read (the reader reads again); commits that
	// linger after writing data are still running when the reader looks again, so the
	// sectors it read from the provider are taken from the committing batch instead.
	for _, lingering := range []time.Duration{0, time.Millisecond} {
		t.Run(fmt.Sprint("lingering=", lingering), func(t *testing.T) {
			t.Parallel()
			testReadDuringCommit(t, lingering)
		})
	}
}

func testReadDuringCommit(t *testing.T, lingering time.Duration) {
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 300)
	v.cfg.Logger = discardLogger()
	d, err := Open(slowReader{v.mem, v.l.DataOffset + int64(v.l.MetaBlockSize()), 300 * time.Microsecond, lingering}, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	const hot = 8 // sectors 0..7, one run in group 0
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		p := make([]byte, hot*512)
		for gen := byte(1); ; gen++ {
			select {
			case <-stop:
				return
			default:
			}
			for i := range p {
				p[i] = gen
			}
			if err := d.WriteAt(p, 0, FUA); err != nil {
				t.Error(err)
				return
			}
		}
	})
	var reads, mixed atomic.Int64
	for range 3 {
		wg.Go(func() {
			buf := make([]byte, hot*512)
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := d.ReadAt(buf, 0); err != nil {
					t.Errorf("read during commits: %v", err)
					return
				}
				reads.Add(1)
				for k := range hot {
					sec := buf[k*512 : (k+1)*512]
					for _, b := range sec {
						if b != sec[0] {
							t.Errorf("sector %d mixes two writes", k)
							return
						}
					}
					if sec[0] != buf[0] {
						mixed.Add(1) // sectors of one read from different writes: allowed
					}
				}
			}
		})
	}
	// Run until enough reads overlapped enough commits; bounded for loaded machines.
	deadline := time.Now().Add(20 * time.Second)
	for (reads.Load() < 450 || d.Stats().Commits < 200) && !t.Failed() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if c, r := d.Stats().Commits, reads.Load(); c < 200 || r < 450 {
		t.Fatalf("only %d commits during %d reads", c, r)
	}
	// A read that lost the race opens the sector with a record that does not match; that
	// must be neither returned nor counted and logged as an authentication failure.
	if n := d.Stats().AuthFailures; n != 0 {
		t.Errorf("%d authentication failures reported by reads that raced a commit", n)
	}
	t.Logf("%d reads during %d commits; %d sectors came from another write than their read's first sector",
		reads.Load(), d.Stats().Commits, mixed.Load())
}

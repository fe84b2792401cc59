package blockdev

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/sector"
)

// holeModel is what Extents should say: per sector, whether it reads as a hole.
type holeModel []bool

// want is the model's extents of [off, off+length).
func (m holeModel) want(off, length int64, s int64) []Extent {
	var out []Extent
	for pos, end := off, off+length; pos < end; {
		i := pos / s
		next := min(end, (i+1)*s)
		h := m[i]
		if n := len(out); n > 0 && out[n-1].Hole == h {
			out[n-1].Length += next - pos
		} else {
			out = append(out, Extent{Length: next - pos, Hole: h, Zero: h})
		}
		pos = next
	}
	return out
}

// checkExtents compares d's answer for [off, off+length) with the model's: the answer
// covers a non-empty prefix of the range, ends on a group boundary if it stops short,
// and matches the model's extents over that prefix exactly.
func checkExtents(t *testing.T, d *Device, m holeModel, off, length int64) int64 {
	t.Helper()
	got, err := d.Extents(off, length)
	if err != nil {
		t.Fatalf("Extents(%d, %d): %v", off, length, err)
	}
	var covered int64
	for _, e := range got {
		if e.Length <= 0 || e.Hole != e.Zero {
			t.Fatalf("Extents(%d, %d): bad extent %+v in %+v", off, length, e, got)
		}
		covered += e.Length
	}
	s := int64(d.SectorSize())
	if len(got) == 0 || covered > length {
		t.Fatalf("Extents(%d, %d) covers %d bytes: %+v", off, length, covered, got)
	}
	if covered < length {
		if r := int64(d.Layout().RecordsPerGroup()); (off+covered)%(s*r) != 0 {
			t.Fatalf("Extents(%d, %d) stops at %d, inside a group", off, length, off+covered)
		}
	}
	if want := m.want(off, covered, s); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Extents(%d, %d) = %+v, want %+v", off, length, got, want)
	}
	return covered
}

// TestExtents drives writes, partial writes, trims and zeroes at random, flushing now and
// then, and checks Extents of random ranges against a model after each step: pending,
// committed and mixed states, unaligned edges, answers cut short at a group boundary.
func TestExtents(t *testing.T) {
	t.Parallel()
	const n = 20000 // sectors: more groups than one answer covers
	for _, size := range []int{512, 4096} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			t.Parallel()
			v := newTestVol(t, sector.ModeXChaCha20Poly1305, size, n)
			v.cfg.CommitInterval = time.Hour // writes stay pending until a Flush
			d := v.open(t)
			defer d.Close()
			s := int64(size)
			m := make(holeModel, n)
			for i := range m {
				m[i] = true
			}
			// A fresh volume is one hole, read in answers that each end at a group boundary.
			if first := checkExtents(t, d, m, 0, d.Size()); first == d.Size() {
				t.Fatalf("one answer covered all %d groups", d.Layout().Groups())
			}
			for off := int64(0); off < d.Size(); {
				off += checkExtents(t, d, m, off, d.Size()-off)
			}
			r := rand.New(rand.NewPCG(1, uint64(size)))
			buf := make([]byte, 40*s)
			for step := range 300 {
				off := r.Int64N(d.Size() - int64(len(buf)))
				length := 1 + r.Int64N(int64(len(buf))-1)
				first, end := off/s, (off+length+s-1)/s     // sectors touched
				wFirst, wEnd := (off+s-1)/s, (off+length)/s // whole sectors
				var err error
				switch op := r.IntN(4); op {
				case 0: // write: every touched sector gets a record
					err = d.WriteAt(buf[:length], off, 0)
					for i := first; i < end; i++ {
						m[i] = false
					}
				case 1: // trim: whole sectors only
					err = d.Trim(off, length, 0)
					for i := wFirst; i < wEnd; i++ {
						m[i] = true
					}
				case 2: // zeroes: whole sectors get a zero record, the edges are written
					err = d.WriteZeroes(off, length, 0)
					for i := first; i < end; i++ {
						m[i] = i >= wFirst && i < wEnd
					}
				case 3: // zeroes that must not leave a hole: every sector is written
					err = d.WriteZeroes(off, length, NoHole)
					for i := first; i < end; i++ {
						m[i] = false
					}
				}
				if err != nil {
					t.Fatal(err)
				}
				if step%7 == 0 {
					if err := d.Flush(); err != nil {
						t.Fatal(err)
					}
				}
				checkExtents(t, d, m, off, length)
				qOff := r.Int64N(d.Size() - 1)
				checkExtents(t, d, m, qOff, 1+r.Int64N(min(d.Size()-qOff, 200*s)))
			}
			if d.Stats().Commits == 0 {
				t.Fatal("no commit: committed state was never checked")
			}
		})
	}
}

// TestExtentsLengthPreserving: without records everything is data, in one extent.
func TestExtentsLengthPreserving(t *testing.T) {
	t.Parallel()
	for _, mode := range []sector.Mode{sector.ModeAESXTS256, sector.ModeNone} {
		v := newTestVol(t, mode, 4096, 64)
		d := v.open(t)
		if err := d.Trim(0, d.Size(), 0); err != nil {
			t.Fatal(err)
		}
		got, err := d.Extents(100, 10000)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 1 || got[0] != (Extent{Length: 10000}) {
			t.Errorf("%v: %+v", mode, got)
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestExtentsErrors: ranges outside the device or empty, and a closed device.
func TestExtentsErrors(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 64)
	d := v.open(t)
	for _, r := range [][2]int64{{-1, 10}, {0, -1}, {0, 0}, {d.Size(), 1}, {d.Size() - 10, 11}, {4096, 1 << 62}} {
		if _, err := d.Extents(r[0], r[1]); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("Extents(%d, %d): %v, want EINVAL", r[0], r[1], err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Extents(0, 4096); !errors.Is(err, ErrClosed) {
		t.Errorf("Extents on a closed device: %v", err)
	}
}

// dataReadWatch fails the test on any read of a data sector while armed.
type dataReadWatch struct {
	*memProvider
	t     *testing.T
	l     Layout
	mu    sync.Mutex
	armed bool
	reads int
}

func (p *dataReadWatch) ReadAt(b []byte, off int64) (int, error) {
	p.mu.Lock()
	if p.armed {
		p.reads++
		rel := off - p.l.DataOffset
		if rel < 0 || rel%p.l.GroupLen() != 0 || len(b) != p.l.MetaBlockSize() {
			p.t.Errorf("Extents read [%d, %d), not a metadata block", off, off+int64(len(b)))
		}
	}
	p.mu.Unlock()
	return p.memProvider.ReadAt(b, off)
}

// TestExtentsReadsNoData: Extents loads metadata blocks, never sector data, and a second
// query of the same range finds them in the cache.
func TestExtentsReadsNoData(t *testing.T) {
	t.Parallel()
	skipFormat2(t)
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 1000)
	p := &dataReadWatch{memProvider: v.mem, t: t, l: v.l}
	d, err := Open(p, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.WriteAt(make([]byte, 64<<10), 1<<20, FUA); err != nil {
		t.Fatal(err)
	}
	// Reopen with a cold cache.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if d, err = Open(p, v.cfg); err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	p.mu.Lock()
	p.armed = true
	p.mu.Unlock()
	got, err := d.Extents(0, d.Size())
	if err != nil {
		t.Fatal(err)
	}
	want := []Extent{{1 << 20, true, true}, {64 << 10, false, false}, {d.Size() - 1<<20 - 64<<10, true, true}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("extents %+v, want %+v", got, want)
	}
	p.mu.Lock()
	loads := p.reads
	p.mu.Unlock()
	if groups := int(v.l.Groups()); loads != groups {
		t.Fatalf("%d reads for %d groups", loads, groups)
	}
	if _, err := d.Extents(0, d.Size()); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reads != loads {
		t.Fatalf("a second query read the provider %d more times", p.reads-loads)
	}
}

// TestExtentsDuringCommits: sectors being rewritten while commits run (pending, then
// committing, then in place) are data in every answer, and untouched ones holes.
func TestExtentsDuringCommits(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 1000)
	v.cfg.CommitInterval = time.Millisecond
	v.cfg.CommitBytes = 64 << 10
	d := v.open(t)
	defer d.Close()
	const written = 256 << 10 // the first 64 sectors
	buf := make([]byte, written)
	if err := d.WriteAt(buf, 0, 0); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := d.WriteAt(buf[:16<<10], int64(k%16)*16<<10, 0); err != nil {
				t.Error(err)
				return
			}
		}
	})
	want := []Extent{{written, false, false}, {512 << 10, true, true}}
	// At least 2000 queries, and on until two commits ran under them: on a loaded machine
	// the writer may not get a core during the first 2000 (a hang guard bounds the rest).
	deadline := time.Now().Add(time.Minute)
	for q := 0; q < 2000 || (d.Stats().Commits < 2 && time.Now().Before(deadline)); q++ {
		got, err := d.Extents(0, written+512<<10)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("extents %+v, want %+v", got, want)
		}
	}
	close(stop)
	wg.Wait()
	if d.Stats().Commits < 2 {
		t.Fatalf("%d commits: the queries never raced one", d.Stats().Commits)
	}
}

package provider

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/cputime"
)

// BenchmarkFreshReads measures what reading a file on tmpfs costs a fresh open, in CPU
// time per byte, for the first, second and third pass over the same data, three ways:
// the first read of each chunk by pread (pread-first), every read through the mapping,
// the first one faulting its pages in (map-first), and as File chooses between the two
// by sampling its first reads (chosen; chose-pread is the share of opens that chose
// pread, sampled-map/pread what its samples measured). Each iteration opens the file afresh for each way, in rotating order, so that
// the machine's load falls on all alike:
//
//	go test -run '^$' -bench FreshReads -benchtime 5x -count 3 ./provider/
//
// seq-256k reads the 256 MiB file in order in 256 KiB pieces (nbdcopy's request
// size); rand-4k reads as many 4 KiB pieces at random offsets, the same ones each pass.
// docs/benchmarks.md ("A fresh server") has the figures.
func BenchmarkFreshReads(b *testing.B) {
	const size = 256 << 20
	path := shmFile(b, size)
	w, err := Open(path, false)
	if err != nil {
		b.Fatal(err)
	}
	fill := make([]byte, 1<<20)
	for off := int64(0); off < size; off += int64(len(fill)) {
		for i := range fill {
			fill[i] = byte(off>>20) + byte(i)
		}
		if _, err := w.WriteAt(fill, off); err != nil {
			b.Fatal(err)
		}
	}
	w.Close()
	for _, pat := range []struct {
		name string
		n    int
	}{{"seq-256k", 256 << 10}, {"rand-4k", 4096}} {
		offs := make([]int64, size/pat.n)
		rng := rand.New(rand.NewPCG(1, 2))
		for i := range offs {
			offs[i] = int64(i * pat.n)
			if pat.n == 4096 {
				offs[i] = rng.Int64N(size/4096) * 4096
			}
		}
		b.Run(pat.name, func(b *testing.B) {
			buf := make([]byte, pat.n)
			const passes = 3
			ways := []struct {
				name string
				way  int32
			}{{"pread-first", wayPread}, {"map-first", wayMap}, {"chosen", wayUndecided}}
			var cpu [3][passes]time.Duration
			iter, chosePread := 0, 0
			var sampleRatio float64 // sum over the chosen opens that decided
			for b.Loop() {
				for k := range ways {
					way := (k + iter) % len(ways)
					p, err := Open(path, true)
					if err != nil {
						b.Fatal(err)
					}
					if !p.Mapped() {
						b.Skip("the file is not mapped: not on tmpfs")
					}
					p.first.way.Store(ways[way].way)
					for pass := range passes {
						start := cputime.Process()
						for _, off := range offs {
							if _, err := p.ReadAt(buf, off); err != nil {
								b.Fatal(err)
							}
						}
						cpu[way][pass] += cputime.Process() - start
					}
					if ways[way].way == wayUndecided {
						if p.first.way.Load() == wayPread {
							chosePread++
						}
						f := &p.first
						if f.bytes[0].Load() > 0 && f.bytes[1].Load() > 0 {
							sampleRatio += float64(f.ns[0].Load()) / float64(f.bytes[0].Load()) /
								(float64(f.ns[1].Load()) / float64(f.bytes[1].Load()))
						}
					}
					p.Close()
				}
				iter++
			}
			perByte := func(d time.Duration) float64 {
				return float64(d.Nanoseconds()) / float64(iter) / float64(len(offs)*pat.n)
			}
			for way, w := range ways {
				for pass, pn := range []string{"first", "second", "third"} {
					b.ReportMetric(perByte(cpu[way][pass]), w.name+"-"+pn+"-cpu-ns/B")
				}
			}
			b.ReportMetric(float64(chosePread)/float64(iter), "chose-pread")
			if sampleRatio > 0 { // the mapping's first reads per byte over pread's, as sampled
				b.ReportMetric(sampleRatio/float64(iter), "sampled-map/pread")
			}
		})
	}
}

package nbdclient

import (
	"bytes"
	"cmp"
	"crypto/rand"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// Benchmarks of Remote side by side with libnbd's own tools on the same export: nbdkit's
// file plugin over TCP behind its delay filter (1 ms per read and per write, a network
// and storage round trip; NBD_BENCH_DELAY=5ms sets another), so that what is measured
// is how well requests are pipelined.
//
//	go test -run '^$' -bench RemoteVsDirect -benchtime 3s ./nbdclient/
//
// seq-read and seq-write move the whole export (MB/s): the client from 64 goroutines in
// 1 MiB calls over its pool of 4 connections, nbdcopy with its defaults (4 connections,
// 64 requests of 256 KiB in flight each, and --flush as the client's Sync); randwrite-4k-qd32 is 4 KiB writes
// at random aligned offsets, 32 in flight (IOPS; fio's nbd engine, iodepth 32).

const benchSize = 128 << 20

func benchServer(b *testing.B) *server {
	b.Helper()
	img := filepath.Join(b.TempDir(), "bench.img")
	data := make([]byte, benchSize)
	rand.Read(data) // no holes: nbdcopy would skip them
	if err := os.WriteFile(img, data, 0o600); err != nil {
		b.Fatal(err)
	}
	delay := cmp.Or(os.Getenv("NBD_BENCH_DELAY"), "1ms")
	s := nbdkit(b, "tcp", nil, "--filter=delay", "file", img, "delay-read="+delay, "delay-write="+delay)
	return s
}

func BenchmarkRemoteVsDirect(b *testing.B) {
	s := benchServer(b)
	const calls, callSize = 64, 1 << 20

	// seqCalls spreads the export over `calls` goroutines in callSize pieces.
	seq := func(b *testing.B, f func(p []byte, off int64) error, after ...func() error) {
		b.SetBytes(benchSize)
		bufs := make([][]byte, calls)
		for i := range bufs {
			bufs[i] = make([]byte, callSize)
			rand.Read(bufs[i]) // zeroes could be detected and skipped
		}
		var next atomic.Int64
		for b.Loop() {
			next.Store(0)
			var wg sync.WaitGroup
			for i := range calls {
				wg.Add(1)
				go func() {
					defer wg.Done()
					p := bufs[i]
					for {
						off := next.Add(callSize) - callSize
						if off >= benchSize {
							return
						}
						if err := f(p, off); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			for _, g := range after {
				if err := g(); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	b.Run("client/seq-read", func(b *testing.B) {
		r := open(b, s.uri, nil)
		seq(b, func(p []byte, off int64) error { _, err := r.ReadAt(p, off); return err })
	})
	b.Run("client/seq-write", func(b *testing.B) {
		r := open(b, s.uri, nil)
		// Each pass ends with a Sync, as each nbdcopy --flush run ends with a flush.
		seq(b, func(p []byte, off int64) error { _, err := r.WriteAt(p, off); return err }, r.Sync)
	})
	b.Run("nbdcopy/seq-read", func(b *testing.B) {
		nbdcopy := testtool.Need(b, "nbdcopy", "libnbd-bin")
		b.SetBytes(benchSize)
		for b.Loop() {
			if out, err := exec.Command(nbdcopy, s.uri, "null:").CombinedOutput(); err != nil {
				b.Fatalf("nbdcopy: %v\n%s", err, out)
			}
		}
	})
	b.Run("nbdcopy/seq-write", func(b *testing.B) {
		nbdcopy := testtool.Need(b, "nbdcopy", "libnbd-bin")
		// Random data of its own: nbdcopy turns runs of zeroes into NBD_CMD_WRITE_ZEROES.
		src := filepath.Join(b.TempDir(), "src.img")
		data := make([]byte, benchSize)
		rand.Read(data)
		if err := os.WriteFile(src, data, 0o600); err != nil {
			b.Fatal(err)
		}
		b.SetBytes(benchSize)
		for b.Loop() {
			if out, err := exec.Command(nbdcopy, "--flush", src, s.uri).CombinedOutput(); err != nil {
				b.Fatalf("nbdcopy: %v\n%s", err, out)
			}
		}
	})
	b.Run("client/randwrite-4k-qd32", func(b *testing.B) {
		r := open(b, s.uri, nil)
		var left atomic.Int64
		left.Store(int64(b.N))
		start := time.Now()
		var wg sync.WaitGroup
		for w := range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := mrand.New(mrand.NewPCG(uint64(w), 3))
				p := make([]byte, 4096)
				rand.Read(p)
				for left.Add(-1) >= 0 {
					if _, err := r.WriteAt(p, rng.Int64N(benchSize/4096)*4096); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "IOPS")
	})
	b.Run("fio/randwrite-4k-qd32", func(b *testing.B) {
		fio := testtool.Need(b, "fio", "fio")
		var iops float64
		for b.Loop() {
			out, err := exec.Command(fio, "--name=rw", "--ioengine=nbd", "--uri="+s.uri, "--rw=randwrite", "--bs=4k",
				"--iodepth=32", fmt.Sprintf("--size=%d", benchSize), "--runtime=3", "--time_based", "--output-format=json").Output()
			if err != nil {
				b.Fatalf("fio: %v\n%s", err, out)
			}
			// fio's nbd engine says "fio: connected to NBD server" before the document.
			if i := bytes.IndexByte(out, '{'); i > 0 {
				out = out[i:]
			}
			var res struct {
				Jobs []struct {
					Write struct {
						IOPS float64 `json:"iops"`
					} `json:"write"`
				} `json:"jobs"`
			}
			if err := json.Unmarshal(out, &res); err != nil || len(res.Jobs) != 1 {
				b.Fatalf("fio output: %v\n%s", err, out)
			}
			iops = res.Jobs[0].Write.IOPS
		}
		b.ReportMetric(iops, "IOPS")
	})
}

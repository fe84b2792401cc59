package nbd

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// BenchmarkVsNbdkit measures this server beside nbdkit's file plugin, serving the same
// tmpfs file, in the same run, with the same clients, and reports the ratio:
//
//	go test ./nbd -run '^$' -bench VsNbdkit -benchtime 5x
//
// nbdcopy copies 1 GiB each way (read: export to null:, write: a tmpfs file to the
// export); fio's nbd engine runs 4 KiB random reads and writes at queue depth 32 for a
// bounded time. Both servers run as their own processes (this one is the test binary in
// its serving mode, see TestMain; GOMAXPROCS in the environment reaches it), and the two
// take turns going first. Metrics: each server's median rate (MB/s or IOPS), eli/nbdkit as
// the median of the per-iteration ratios (runs next to each other in time see the same
// machine load, which on a shared machine moves more than the servers differ), and each
// server's CPU time per MB or per I/O, a steadier measure of cost.
//
// On a busy machine (load above the core count) 4 KiB random writes are bimodal for this
// server: some runs take several context switches per I/O instead of one, and much
// more CPU, as the Go scheduler parks and wakes threads between the reader and the
// workers; the I/O path itself is the same in both (profiled: system calls are nearly
// all of the server's CPU in either).
func BenchmarkVsNbdkit(b *testing.B) {
	for _, tool := range []string{"nbdkit", "nbdcopy", "fio"} {
		if _, err := exec.LookPath(tool); err != nil {
			b.Skipf("%s is not installed: %v", tool, err)
		}
	}
	const size = 1 << 30
	dir, err := os.MkdirTemp("/dev/shm", "nbdbench")
	if err != nil {
		b.Skipf("no /dev/shm: %v", err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	img := filepath.Join(dir, "disk.img")
	src := filepath.Join(dir, "src.img")
	for _, f := range []string{img, src} {
		if err := writeRandomFile(f, size); err != nil {
			b.Fatal(err)
		}
	}
	servers := []*benchServer{
		startEliServer(b, filepath.Join(dir, "eli.sock"), img),
		startNbdkit(b, filepath.Join(dir, "nbdkit.sock"), img),
	}

	// Each run returns its rate (MB/s or IOPS) and the amount of work done (MB or I/Os),
	// so that server CPU time per unit of work can be reported too.
	type workload struct {
		name, unit string
		run        func(b *testing.B, uri string) (rate, work float64)
	}
	nbdcopy := func(args ...string) (float64, float64) {
		start := time.Now()
		out, err := runErr(5*time.Minute, "nbdcopy", args...)
		if err != nil {
			b.Fatalf("nbdcopy %v: %v\n%s", args, err, out)
		}
		return float64(size) / 1e6 / time.Since(start).Seconds(), float64(size) / 1e6
	}
	fio := func(uri, rw string) (float64, float64) {
		out, err := runErr(2*time.Minute, "fio", "--name=bench", "--ioengine=nbd", "--uri="+uri,
			"--rw="+rw, "--bs=4k", "--iodepth=32", "--size=1g", "--time_based", "--runtime=8",
			"--ramp_time=1", "--output-format=json")
		if err != nil {
			b.Fatalf("fio: %v\n%s", err, out)
		}
		var res struct {
			Jobs []struct {
				Read, Write struct {
					IOPS     float64 `json:"iops"`
					TotalIOs float64 `json:"total_ios"`
				}
			} `json:"jobs"`
		}
		// fio may print notices before the JSON document.
		if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &res); err != nil || len(res.Jobs) != 1 {
			b.Fatalf("fio output: %v\n%s", err, out)
		}
		j := res.Jobs[0]
		return j.Read.IOPS + j.Write.IOPS, j.Read.TotalIOs + j.Write.TotalIOs
	}
	workloads := []workload{
		{"nbdcopy-read-1GiB", "MB/s", func(b *testing.B, uri string) (float64, float64) { return nbdcopy(uri, "null:") }},
		{"nbdcopy-write-1GiB", "MB/s", func(b *testing.B, uri string) (float64, float64) { return nbdcopy(src, uri) }},
		{"fio-randread-4k-qd32", "IOPS", func(b *testing.B, uri string) (float64, float64) { return fio(uri, "randread") }},
		{"fio-randwrite-4k-qd32", "IOPS", func(b *testing.B, uri string) (float64, float64) { return fio(uri, "randwrite") }},
	}
	for _, w := range workloads {
		b.Run(w.name, func(b *testing.B) {
			rates := map[string][]float64{}
			cpu := map[string]time.Duration{}
			work := map[string]float64{}
			for i := 0; i < b.N; i++ {
				for k := range servers {
					s := servers[(i+k)%len(servers)]
					before := s.cpuTime(b)
					rate, done := w.run(b, s.uri)
					cpu[s.name] += s.cpuTime(b) - before
					work[s.name] += done
					rates[s.name] = append(rates[s.name], rate)
				}
			}
			eli, kit := median(rates["eli"]), median(rates["nbdkit"])
			var ratios []float64
			for i := range rates["eli"] {
				ratios = append(ratios, rates["eli"][i]/rates["nbdkit"][i])
			}
			ratio := median(ratios)
			b.ReportMetric(eli, "eli-"+w.unit)
			b.ReportMetric(kit, "nbdkit-"+w.unit)
			b.ReportMetric(ratio, "eli/nbdkit")
			per := "µs/MB"
			if w.unit == "IOPS" {
				per = "µs/IO"
			}
			ecpu := float64(cpu["eli"].Microseconds()) / work["eli"]
			kcpu := float64(cpu["nbdkit"].Microseconds()) / work["nbdkit"]
			b.ReportMetric(ecpu, "eli-cpu-"+per)
			b.ReportMetric(kcpu, "nbdkit-cpu-"+per)
			load, _ := os.ReadFile("/proc/loadavg")
			b.Logf("%s: eli %v, nbdkit %v (%s), median ratio %.3f; server CPU eli %.2f, nbdkit %.2f %s (ratio %.2f); loadavg %s",
				w.name, round(rates["eli"]), round(rates["nbdkit"]), w.unit, ratio, ecpu, kcpu, per, ecpu/kcpu, strings.Fields(string(load))[0])
		})
	}
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func round(v []float64) []float64 {
	r := make([]float64, len(v))
	for i, x := range v {
		r[i] = float64(int64(x*10)) / 10
	}
	return r
}

func writeRandomFile(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	r := rand.NewChaCha8([32]byte{1})
	buf := make([]byte, 1<<20)
	for n := int64(0); n < size; n += int64(len(buf)) {
		r.Read(buf)
		if _, err := w.Write(buf); err != nil {
			f.Close()
			return err
		}
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

type benchServer struct {
	name, uri string
	pid       int
}

// cpuTime is the CPU time (user + system, all threads) the server process has used. On a
// shared machine it is a steadier measure of a server's cost than throughput is.
func (s *benchServer) cpuTime(b *testing.B) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", s.pid))
	if err != nil {
		b.Fatalf("read %s CPU time: %v", s.name, err)
	}
	// Fields after the parenthesised command name; utime and stime are fields 14 and 15.
	f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	var ut, st int64
	fmt.Sscan(f[11], &ut)
	fmt.Sscan(f[12], &st)
	const ticksPerSecond = 100 // USER_HZ, fixed at 100 on Linux for /proc
	return time.Duration(ut+st) * time.Second / ticksPerSecond
}

func startEliServer(b *testing.B, sock, img string) *benchServer {
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), "NBD_TEST_SERVE="+sock+" "+img)
	if prof := os.Getenv("NBD_BENCH_CPUPROFILE"); prof != "" {
		cmd.Env = append(cmd.Env, "NBD_TEST_CPUPROFILE="+prof)
	}
	startServerProcess(b, cmd, sock)
	return &benchServer{"eli", uriFor(sock, ""), cmd.Process.Pid}
}

func startNbdkit(b *testing.B, sock, img string) *benchServer {
	cmd := exec.Command("nbdkit", "--foreground", "--exit-with-parent", "--unix", sock, "file", img)
	startServerProcess(b, cmd, sock)
	return &benchServer{"nbdkit", uriFor(sock, ""), cmd.Process.Pid}
}

func startServerProcess(b *testing.B, cmd *exec.Cmd, sock string) {
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		b.Fatalf("start %s: %v", cmd.Path, err)
	}
	b.Cleanup(func() {
		// SIGTERM, so the eli server stops gracefully and writes its profile.
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s never listened on %s:\n%s", cmd.Path, sock, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// nullBackend does no work, so that BenchmarkServer measures the server alone.
type nullBackend struct{ size int64 }

func (n nullBackend) Size() int64                              { return n.size }
func (nullBackend) ReadAt(p []byte, off int64) error           { return nil }
func (nullBackend) WriteAt(p []byte, off int64, f Flags) error { return nil }
func (nullBackend) WriteZeroes(off, n int64, f Flags) error    { return nil }
func (nullBackend) Trim(off, n int64, f Flags) error           { return nil }
func (nullBackend) Flush() error                               { return nil }

// BenchmarkServer drives the server in-process with a pipelining raw client (32 requests
// in flight) over a unix socket: the server's own cost per request, its allocations, and
// the system calls that wrote replies per request (reply.go gathers them).
func BenchmarkServer(b *testing.B) {
	for _, tc := range []struct {
		name string
		typ  uint16
		size int
	}{
		{"read-4k", nbdproto.CmdRead, 4 << 10},
		{"write-4k", nbdproto.CmdWrite, 4 << 10},
		{"read-256k", nbdproto.CmdRead, 256 << 10},
		{"write-256k", nbdproto.CmdWrite, 256 << 10},
	} {
		b.Run(tc.name, func(b *testing.B) {
			srv := &Server{Exports: []Export{{Backend: nullBackend{1 << 30}}}}
			srv.Logger = slog.New(slog.DiscardHandler)
			path := serveUnix(b, srv)
			rc := dialRaw(b, path)
			rc.c.SetDeadline(time.Time{})
			if _, err := rc.connect("", true); err != nil {
				b.Fatal(err)
			}
			var payload []byte
			if tc.typ == nbdproto.CmdWrite {
				payload = make([]byte, tc.size)
			}
			const depth = 32
			frames := make([][]byte, depth)
			for i := range frames {
				frames[i] = reqBytes(tc.typ, 0, uint64(i), uint64(i*tc.size), uint32(tc.size), payload)
			}
			br := bufio.NewReaderSize(rc.c, 1<<20)
			var hdr [nbdproto.StructuredHeaderLen]byte
			readOne := func() {
				if _, err := io.ReadFull(br, hdr[:4]); err != nil {
					b.Fatal(err)
				}
				n := 0
				if binary.BigEndian.Uint32(hdr[:4]) == nbdproto.MagicSimpleReply {
					n = nbdproto.SimpleReplyHeaderLen - 4
				} else {
					if _, err := io.ReadFull(br, hdr[4:]); err != nil {
						b.Fatal(err)
					}
					n = int(binary.BigEndian.Uint32(hdr[16:]))
				}
				if _, err := br.Discard(n); err != nil {
					b.Fatal(err)
				}
			}
			b.SetBytes(int64(tc.size))
			b.ReportAllocs()
			w0 := replyWrites(srv)
			b.ResetTimer()
			sent := 0
			for ; sent < depth && sent < b.N; sent++ {
				rc.write(frames[sent%depth])
			}
			for done := 0; done < b.N; done++ {
				readOne()
				if sent < b.N {
					rc.write(frames[sent%depth])
					sent++
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(replyWrites(srv)-w0)/float64(b.N), "reply-writes/op")
		})
	}
}

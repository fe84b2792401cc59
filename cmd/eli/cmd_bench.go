package main

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elidisk/eli/sector"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"
)

type benchOptions struct {
	sectorSize int
	threads    int
	duration   time.Duration
	json       bool
	ciphers    []string
}

func newBenchCmd() *cobra.Command {
	o := &benchOptions{}
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure every cipher mode's throughput in this process",
		Long: `Bench measures how fast each cipher mode seals (encrypt) and opens (decrypt)
sectors in memory, at sector sizes 512 and 4096, with random keys that are never
shown. It uses as many threads as the server would (all cores) unless --threads
says otherwise, and prints MB/s (10^6 bytes per second) of plaintext.

No I/O is involved: this is the ceiling the codec sets, not what an attached
volume delivers (bench/run in the source tree measures that). Encrypt seals from
one buffer into another, as a write does; decrypt copies the ciphertext into
place and opens it, as a read does, so 'none' shows the cost of moving the bytes.`,
		Example: `  eli bench
  eli bench --sector-size 4096 --threads 1 --duration 1s
  eli bench --json --cipher xchacha20-poly1305 --cipher aes-xts`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runBench(cmd, o)
		},
	}
	f := cmd.Flags()
	f.IntVarP(&o.sectorSize, "sector-size", "s", 0, "measure only this sector size (default: 512 and 4096)")
	f.IntVarP(&o.threads, "threads", "t", runtime.GOMAXPROCS(0), "threads working at once; the default is all cores, as the server uses")
	f.DurationVar(&o.duration, "duration", 250*time.Millisecond, "time spent on each direction of each cell")
	f.BoolVar(&o.json, "json", false, "print JSON instead of a table")
	f.StringArrayVarP(&o.ciphers, "cipher", "e", nil, "measure only this mode (repeatable; default: every mode)")
	addProfileFlags(cmd)
	return cmd
}

// benchResult is one cell of the table (and one element of --json's "results").
type benchResult struct {
	Mode        string  `json:"mode"`
	SectorSize  int     `json:"sector_size"`
	EncryptMBps float64 `json:"encrypt_mbps"`
	DecryptMBps float64 `json:"decrypt_mbps"`
	Unsafe      bool    `json:"unsafe,omitempty"`
}

type benchReport struct {
	Threads    int           `json:"threads"`
	DurationMS int64         `json:"duration_ms"`
	GoVersion  string        `json:"go_version"`
	GOARCH     string        `json:"goarch"`
	Results    []benchResult `json:"results"`
}

func (o *benchOptions) plan() ([]sector.Mode, []int, error) {
	sizes := []int{512, 4096}
	if o.sectorSize != 0 {
		if !sector.ValidSectorSize(o.sectorSize) {
			return nil, nil, usagef("--sector-size %d: need a power of two from %d to %d",
				o.sectorSize, sector.MinSectorSize, sector.MaxSectorSize)
		}
		sizes = []int{o.sectorSize}
	}
	if o.threads < 1 || o.threads > 1024 {
		return nil, nil, usagef("--threads must be 1 to 1024, got %d", o.threads)
	}
	if o.duration < time.Millisecond || o.duration > time.Hour {
		return nil, nil, usagef("--duration must be between 1ms and 1h, got %v", o.duration)
	}
	modes := sector.Modes()
	if len(o.ciphers) > 0 {
		modes = modes[:0:0]
		for _, name := range o.ciphers {
			m, err := sector.ParseMode(name)
			if err != nil {
				return nil, nil, usageError{err}
			}
			modes = append(modes, m)
		}
	}
	return modes, sizes, nil
}

func runBench(cmd *cobra.Command, o *benchOptions) error {
	modes, sizes, err := o.plan()
	if err != nil {
		return err
	}
	bar := newBenchBar(len(modes) * len(sizes) * 2)
	rep := benchReport{
		Threads: o.threads, DurationMS: o.duration.Milliseconds(),
		GoVersion: runtime.Version(), GOARCH: runtime.GOARCH,
	}
	for _, m := range modes {
		for _, s := range sizes {
			bar.Describe(fmt.Sprintf("%s %d", m, s))
			r, err := benchCell(m, s, o.threads, o.duration, func() { bar.Add(1) })
			if err != nil {
				bar.Clear()
				return err
			}
			rep.Results = append(rep.Results, r)
		}
	}
	bar.Finish()
	out := cmd.OutOrStdout()
	if o.json {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	return printBenchTable(out, rep)
}

// newBenchBar draws progress on stderr, and only when stderr is a terminal: a script
// that captures stderr gets the error line and nothing else.
func newBenchBar(steps int) *progressbar.ProgressBar {
	visible := term.IsTerminal(int(os.Stderr.Fd()))
	return progressbar.NewOptions(steps,
		progressbar.OptionSetWriter(os.Stderr),
		progressbar.OptionSetVisibility(visible),
		progressbar.OptionSetWidth(30),
		progressbar.OptionShowCount(),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionThrottle(50*time.Millisecond),
	)
}

func printBenchTable(w io.Writer, rep benchReport) error {
	fmt.Fprintf(w, "eli bench: %d thread(s), %v per direction, %s %s; MB/s = 10^6 bytes/s of plaintext\n\n",
		rep.Threads, time.Duration(rep.DurationMS)*time.Millisecond, rep.GoVersion, rep.GOARCH)
	fmt.Fprintf(w, "%-20s %11s %13s %13s\n", "mode", "sector size", "encrypt MB/s", "decrypt MB/s")
	for _, r := range rep.Results {
		line := fmt.Sprintf("%-20s %11d %13.0f %13.0f", r.Mode, r.SectorSize, r.EncryptMBps, r.DecryptMBps)
		if r.Unsafe {
			line += "  UNSAFE: benchmark parity only"
		}
		if _, err := fmt.Fprintln(w, line); err != nil {
			return err
		}
	}
	return nil
}

// benchCell measures one mode at one sector size, encrypt then decrypt. step is called
// after each direction.
func benchCell(m sector.Mode, size, threads int, d time.Duration, step func()) (benchResult, error) {
	key := make([]byte, m.KeySize())
	var vid [16]byte
	if _, err := rand.Read(key); err != nil {
		return benchResult{}, fmt.Errorf("random key: %w", err)
	}
	if _, err := rand.Read(vid[:]); err != nil {
		return benchResult{}, fmt.Errorf("random volume ID: %w", err)
	}
	c, err := sector.New(sector.Params{Mode: m, SectorSize: size, Key: key, VolumeID: vid})
	clear(key)
	if err != nil {
		return benchResult{}, fmt.Errorf("bench %s at %d bytes: %w", m, size, err)
	}
	defer c.Wipe()
	r := benchResult{Mode: m.String(), SectorSize: size, Unsafe: m.Unsafe()}
	if r.EncryptMBps, err = measure(c, threads, d, false); err != nil {
		return r, err
	}
	step()
	if r.DecryptMBps, err = measure(c, threads, d, true); err != nil {
		return r, err
	}
	step()
	return r, nil
}

// benchBatch is how many bytes of sectors a worker handles between looks at the clock:
// small enough to stay in cache, large enough that the look costs nothing.
const benchBatch = 64 << 10

// measure runs threads workers for about d and returns MB/s of plaintext processed.
func measure(c sector.Codec, threads int, d time.Duration, decrypt bool) (float64, error) {
	var stop atomic.Bool
	var total atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, threads)
	ws := make([]*benchWorker, threads)
	for t := range ws {
		var err error
		if ws[t], err = newBenchWorker(c, uint64(t)<<32, decrypt); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	for _, w := range ws {
		wg.Go(func() {
			n, err := w.run(&stop)
			total.Add(n)
			if err != nil {
				errs <- err
			}
		})
	}
	timer := time.AfterFunc(d, func() { stop.Store(true) })
	wg.Wait()
	timer.Stop()
	elapsed := time.Since(start)
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(total.Load()) / 1e6 / elapsed.Seconds(), nil
}

// benchWorker is one thread's buffers: plaintext (or sealed ciphertext and records, for
// decrypt), a destination, and the records.
type benchWorker struct {
	c        sector.Codec
	decrypt  bool
	first    uint64
	n, s     int
	src, dst []byte
	meta     []byte
}

func newBenchWorker(c sector.Codec, first uint64, decrypt bool) (*benchWorker, error) {
	s := c.SectorSize()
	n := max(1, benchBatch/s)
	w := &benchWorker{
		c: c, decrypt: decrypt, first: first, n: n, s: s,
		src:  make([]byte, n*s),
		dst:  make([]byte, n*s),
		meta: make([]byte, n*c.MetaSize()),
	}
	if _, err := rand.Read(w.src); err != nil {
		return nil, fmt.Errorf("random plaintext: %w", err)
	}
	if decrypt {
		// Seal once; every round opens the same ciphertext again.
		if err := w.seal(first, w.src, w.src); err != nil {
			return nil, err
		}
	}
	return w, nil
}

// seal and open take runs of sectors at once, as the device hands them to the codec:
// that is where xchacha*-xts and xchacha20-poly1305 batch their per-sector subkeys.
func (w *benchWorker) seal(first uint64, dst, src []byte) error {
	switch c := w.c.(type) {
	case sector.MetaRunner:
		c.SealRunMeta(first, dst, src, w.meta)
	case sector.Runner:
		c.SealRun(first, dst, src)
	default:
		return fmt.Errorf("bench: %s codec seals no runs", w.c.Mode())
	}
	return nil
}

func (w *benchWorker) open(first uint64, dst, src []byte) error {
	var err error
	switch c := w.c.(type) {
	case sector.MetaRunner:
		err = c.OpenRunMeta(first, dst, src, w.meta)
	case sector.Runner:
		err = c.OpenRun(first, dst, src)
	default:
		return fmt.Errorf("bench: %s codec opens no runs", w.c.Mode())
	}
	if err != nil {
		return fmt.Errorf("bench %s: sectors sealed here do not open: %w", w.c.Mode(), err)
	}
	return nil
}

// run works until stop is set and returns the bytes it processed.
func (w *benchWorker) run(stop *atomic.Bool) (int64, error) {
	var done int64
	// At least one round: a worker scheduled only after the timer fired (a short
	// --duration on a loaded machine) would otherwise report a rate of zero.
	for round := uint64(0); round == 0 || !stop.Load(); round++ {
		var err error
		if w.decrypt {
			err = w.open(w.first, w.dst, w.src)
		} else {
			err = w.seal(w.first+round*uint64(w.n), w.dst, w.src)
		}
		if err != nil {
			return done, err
		}
		done += int64(w.n * w.s)
	}
	return done, nil
}

// addProfileFlags gives cmd a hidden --cpuprofile FILE that writes a pprof CPU profile
// of the whole command: with attach --foreground, of the server until it stops. It lives
// here, beside the benchmarks it serves (bench/run, docs/benchmarks.md); bench and
// attach have it.
//
// --trace FILE, hidden too, writes a Go execution trace the same way (go tool trace):
// where goroutines wait, and for whom, which a profile does not show.
func addProfileFlags(cmd *cobra.Command) {
	var path, tracePath string
	cmd.Flags().StringVar(&path, "cpuprofile", "", "write a CPU profile to FILE")
	cmd.Flags().MarkHidden("cpuprofile")
	cmd.Flags().StringVar(&tracePath, "trace", "", "write an execution trace to FILE")
	cmd.Flags().MarkHidden("trace")
	run := cmd.RunE
	cmd.RunE = func(c *cobra.Command, args []string) error {
		for _, o := range []struct {
			flag, path string
			start      func(io.Writer) error
			stop       func()
		}{
			{"--cpuprofile", path, pprof.StartCPUProfile, pprof.StopCPUProfile},
			{"--trace", tracePath, trace.Start, trace.Stop},
		} {
			if o.path == "" {
				continue
			}
			f, err := os.Create(o.path)
			if err != nil {
				return fmt.Errorf("%s: %w", o.flag, err)
			}
			defer f.Close()
			if err := o.start(f); err != nil {
				return fmt.Errorf("%s: %w", o.flag, err)
			}
			defer o.stop() // before the file's Close: deferred calls run last first
		}
		return run(c, args)
	}
}

// Command bench measures eli's NBD export beside the alternatives a Linux user has for a
// userspace encrypted NBD export, on the same machine, in one run, with the same clients
// (issue 7):
//
//   - nbdkit-file: nbdkit's file plugin, plaintext (the baseline)
//   - qemu-nbd-luks: qemu-nbd serving a LUKS image (aes-xts-plain64, 512-bit key)
//   - nbdkit-luks: nbdkit's luks filter over the file plugin, on a LUKS image
//   - eli-none, eli-xchacha20-poly1305, eli-chacha20-xts, eli-chacha8-xts, eli-aes-xts
//
// Clients: nbdcopy writes and reads the whole export sequentially; fio's nbd engine runs
// 4 KiB random reads and random writes at queue depth 32 for a bounded time. Backing files
// live on tmpfs, preallocated; every server is started first, warmed up with one write
// and one read pass, then each repetition runs every workload on every server, the
// servers' order rotating from one repetition to the next so that a change in the
// machine's load falls on all of them. The sequential write and read each run on a
// server started afresh (cold: what a user's first copy or scan after attach meets),
// then again on the same server (warm); the main tables give the cold figures, and a
// table of their own both. Medians are reported, with each server's CPU time per unit of
// work (steadier than throughput on a shared machine).
//
// The result is a Markdown section (machine, table, ratios, how to reproduce) written
// into docs/benchmarks.md between markers, so the prose around it survives a rerun, and
// a chart (docs/benchmarks.svg). Run it with bench/run; bench/run -h lists the options.
//
// This program is not part of the eli binary: it lives here so that its dependencies
// never reach the CLI's imports.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// options are the command line.
type options struct {
	size    int64
	reps    int
	runtime time.Duration
	targets []string
	dir     string
	out     string // Markdown file to update; "" leaves docs alone
	chart   string // SVG to write; "" for none
	jsonOut string
	eli     string // eli binary; "" builds one
	keep    bool
	check   bool
	args    []string // as given, for the "reproduce" line
}

const usageText = `usage: bench/run [options]

Measures eli beside qemu-nbd + LUKS, nbdkit's luks filter and nbdkit's file plugin
with nbdcopy (sequential write and read of the whole export) and fio's nbd engine
(4 KiB random read and write, queue depth 32), all on tmpfs, in one run. Writes
the results into docs/benchmarks.md (between its bench markers) and the chart
docs/benchmarks.svg, and prints them.

Needs: nbdkit (with the luks filter), nbdcopy and nbdinfo (libnbd-bin), fio (with
the nbd engine), qemu-nbd (qemu-utils), cryptsetup, and Go to build eli. Memory:
about (servers + 1) x --size on tmpfs.

Options:
`

func parseOptions(args []string, stderr io.Writer) (*options, error) {
	o := &options{args: args}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usageText)
		fs.PrintDefaults()
		fmt.Fprintf(stderr, "\nServers (--targets): %s\n", strings.Join(allTargetNames(), ","))
	}
	size := fs.String("size", "1G", "bytes each export holds and each sequential pass moves (K, M, G suffixes: powers of 1024)")
	fs.IntVar(&o.reps, "reps", 5, "measured repetitions of every workload on every server (median reported)")
	fs.DurationVar(&o.runtime, "runtime", 0, "length of each fio run (default: 5s, or 1s when --size is under 256M)")
	targets := fs.String("targets", strings.Join(allTargetNames(), ","), "comma-separated servers to measure")
	fs.StringVar(&o.dir, "dir", "/dev/shm", "tmpfs directory for backing files, sockets and the source file")
	fs.StringVar(&o.out, "out", "docs/benchmarks.md", "Markdown file whose bench section is replaced (\"\" for none)")
	fs.StringVar(&o.chart, "chart", "", "SVG chart to write (default: benchmarks.svg beside --out)")
	fs.StringVar(&o.jsonOut, "json", "", "also write every measurement as JSON to this file")
	fs.StringVar(&o.eli, "eli", "", "eli binary to measure (default: go build ./cmd/eli)")
	fs.BoolVar(&o.keep, "keep", false, "keep the working directory (images, logs) afterwards")
	fs.BoolVar(&o.check, "check", false, "exit 3 when eli misses one of issue 7's targets")
	quick := fs.Bool("quick", false, "quick check: --size 64M --reps 1 --runtime 1s")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (options only; see -h)", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *quick {
		if !set["size"] {
			*size = "64M"
		}
		if !set["reps"] {
			o.reps = 1
		}
		if !set["runtime"] {
			o.runtime = time.Second
		}
	}
	var err error
	if o.size, err = parseSize(*size); err != nil {
		return nil, fmt.Errorf("--size: %w", err)
	}
	if o.size < 16<<20 || o.size > 64<<30 || o.size%(1<<20) != 0 {
		return nil, fmt.Errorf("--size %s: need a whole number of MiB from 16M to 64G", *size)
	}
	if o.reps < 1 || o.reps > 100 {
		return nil, fmt.Errorf("--reps %d: need 1 to 100", o.reps)
	}
	if o.runtime == 0 {
		o.runtime = 5 * time.Second
		if o.size < 256<<20 {
			o.runtime = time.Second
		}
	}
	if o.runtime < time.Second || o.runtime > 10*time.Minute {
		return nil, fmt.Errorf("--runtime %v: need 1s to 10m", o.runtime)
	}
	if o.targets, err = parseTargets(*targets); err != nil {
		return nil, err
	}
	if o.chart == "" && o.out != "" {
		o.chart = strings.TrimSuffix(o.out, ".md") + ".svg"
	}
	return o, nil
}

// parseSize reads a byte count with an optional K, M or G suffix (powers of 1024).
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(strings.ToUpper(s))
	s = strings.TrimSuffix(strings.TrimSuffix(s, "B"), "I")
	mult := int64(1)
	if n := len(s); n > 0 {
		switch s[n-1] {
		case 'K':
			mult, s = 1<<10, s[:n-1]
		case 'M':
			mult, s = 1<<20, s[:n-1]
		case 'G':
			mult, s = 1<<30, s[:n-1]
		}
	}
	var v int64
	if _, err := fmt.Sscanf(s, "%d", &v); err != nil || fmt.Sprint(v) != s {
		return 0, fmt.Errorf("%q is not a size like 64M or 1G", s)
	}
	if v < 0 || v > (1<<62)/mult {
		return 0, fmt.Errorf("%q is out of range", s)
	}
	return v * mult, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseOptions(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "bench: %v\n", err)
		return 2
	}
	rep, err := measureAll(ctx, o, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "bench: %v\n", err)
		return 1
	}
	if err := writeOutputs(o, rep, stdout); err != nil {
		fmt.Fprintf(stderr, "bench: %v\n", err)
		return 1
	}
	if missed := rep.missedTargets(); len(missed) > 0 && o.check {
		fmt.Fprintf(stderr, "bench: eli misses %d issue 7 target(s): %s\n", len(missed), strings.Join(missed, "; "))
		return 3
	}
	return 0
}

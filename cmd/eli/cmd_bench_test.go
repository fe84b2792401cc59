package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/elidisk/eli/sector"
)

// TestBenchTable checks the table's shape: a header, then one row per mode and sector
// size, in sector.Modes() order, with two positive rates each; unsafe modes say so.
func TestBenchTable(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		args  []string
		modes []sector.Mode
		sizes []int
	}{
		{"every mode, both sizes", nil, sector.Modes(), []int{512, 4096}},
		{"one size", []string{"--sector-size", "4096"}, sector.Modes(), []int{4096}},
		{"chosen modes, one thread", []string{"-e", "aes-xts", "--cipher", "chacha8-xts", "--threads", "1", "-s", "512"},
			[]sector.Mode{sector.ModeAESXTS256, sector.ModeChaCha8XTS}, []int{512}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			r := e.OK(append([]string{"bench", "--duration", "2ms"}, tc.args...)...)
			if r.Stderr != "" {
				t.Errorf("stderr is not a terminal, yet something was written there: %q", r.Stderr)
			}
			lines := strings.Split(strings.TrimRight(r.Stdout, "\n"), "\n")
			hdr := -1
			for i, l := range lines {
				if strings.HasPrefix(l, "mode ") {
					hdr = i
					break
				}
			}
			if hdr < 0 {
				t.Fatalf("no header line:\n%s", r.Stdout)
			}
			for _, col := range []string{"sector size", "encrypt MB/s", "decrypt MB/s"} {
				if !strings.Contains(lines[hdr], col) {
					t.Errorf("header %q lacks %q", lines[hdr], col)
				}
			}
			rows := lines[hdr+1:]
			if want := len(tc.modes) * len(tc.sizes); len(rows) != want {
				t.Fatalf("%d rows, want %d:\n%s", len(rows), want, r.Stdout)
			}
			k := 0
			for _, m := range tc.modes {
				for _, s := range tc.sizes {
					f := strings.Fields(rows[k])
					if len(f) < 4 || f[0] != m.String() || f[1] != strconv.Itoa(s) {
						t.Fatalf("row %d is %q, want %s %d first", k, rows[k], m, s)
					}
					for _, v := range f[2:4] {
						if x, err := strconv.ParseFloat(v, 64); err != nil || !(x > 0) {
							t.Errorf("row %q: rate %q is not a positive number", rows[k], v)
						}
					}
					if got := strings.Contains(rows[k], "UNSAFE"); got != m.Unsafe() {
						t.Errorf("row %q: marked unsafe %v, want %v", rows[k], got, m.Unsafe())
					}
					k++
				}
			}
		})
	}
}

func TestBenchJSON(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.OK("bench", "--json", "--duration", "2ms", "--threads", "3")
	var rep benchReport
	dec := json.NewDecoder(strings.NewReader(r.Stdout))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, r.Stdout)
	}
	if rep.Threads != 3 || rep.DurationMS != 2 || rep.GoVersion == "" {
		t.Errorf("header fields: %+v", rep)
	}
	if want := 2 * len(sector.Modes()); len(rep.Results) != want {
		t.Fatalf("%d results, want %d", len(rep.Results), want)
	}
	seen := map[string]bool{}
	for _, res := range rep.Results {
		m, err := sector.ParseMode(res.Mode)
		if err != nil {
			t.Errorf("elitest.Result names an unknown mode: %v", err)
			continue
		}
		if res.SectorSize != 512 && res.SectorSize != 4096 {
			t.Errorf("%s: sector size %d", res.Mode, res.SectorSize)
		}
		for name, v := range map[string]float64{"encrypt": res.EncryptMBps, "decrypt": res.DecryptMBps} {
			if !(v > 0) || math.IsInf(v, 0) {
				t.Errorf("%s %d: %s rate %v is not a positive number", res.Mode, res.SectorSize, name, v)
			}
		}
		if res.Unsafe != m.Unsafe() {
			t.Errorf("%s: unsafe %v", res.Mode, res.Unsafe)
		}
		seen[res.Mode+"/"+strconv.Itoa(res.SectorSize)] = true
	}
	if len(seen) != len(rep.Results) {
		t.Errorf("a cell appears twice: %v", seen)
	}
	if strings.Contains(strings.ToLower(r.Stdout), "key") {
		t.Errorf("output mentions a key:\n%s", r.Stdout)
	}
}

func TestBenchBadFlagsExit2(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"--sector-size", "1000"}, "power of two"},
		{[]string{"--sector-size", "256"}, "power of two"},
		{[]string{"--sector-size", "131072"}, "power of two"},
		{[]string{"--threads", "0"}, "--threads"},
		{[]string{"--threads", "-2"}, "--threads"},
		{[]string{"--duration", "0s"}, "--duration"},
		{[]string{"--duration", "soon"}, "invalid argument"},
		{[]string{"--cipher", "rot13"}, "unknown cipher mode"},
		{[]string{"--frobnicate"}, "unknown flag"},
		{[]string{"extra"}, "takes 0 argument"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			r := e.FailsCode(exitUsage, tc.want, append([]string{"bench"}, tc.args...)...)
			if r.Stdout != "" {
				t.Errorf("a usage error printed to stdout: %q", r.Stdout)
			}
		})
	}
}

// TestBenchProgressOnTerminal: the bar shows when stderr is a terminal (and the other
// tests check that it does not when stderr is a pipe).
func TestBenchProgressOnTerminal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	shown, code := e.runOnTerminal(nil, "bench", "--duration", "20ms", "-s", "4096", "-e", "none", "-e", "chacha8-xts")
	if code != 0 {
		t.Fatalf("exit %d: %q", code, shown)
	}
	if !strings.Contains(shown, "/4)") {
		t.Errorf("no progress count on the terminal: %q", shown)
	}
	if !strings.Contains(shown, "chacha8-xts") || !strings.Contains(shown, "decrypt MB/s") {
		t.Errorf("no table on the terminal: %q", shown)
	}
}

// TestMeasureStoppedBeforeStart: with the time up before a worker first runs (a zero
// duration stands for a loaded machine), each worker still does one round, so the rate
// is a number, not zero.
func TestMeasureStoppedBeforeStart(t *testing.T) {
	for _, m := range []sector.Mode{sector.ModeNone, sector.ModeXChaCha20Poly1305} {
		c, err := sector.New(sector.Params{Mode: m, SectorSize: 4096, Key: make([]byte, m.KeySize())})
		if err != nil {
			t.Fatal(err)
		}
		for _, decrypt := range []bool{false, true} {
			rate, err := measure(c, 2, 0, decrypt)
			if err != nil {
				t.Fatal(err)
			}
			if !(rate > 0) {
				t.Errorf("%s decrypt=%v: rate %v after a zero duration", m, decrypt, rate)
			}
		}
	}
}

// TestProfileFlags: the hidden --cpuprofile and --trace write a pprof profile (gzip) and
// a Go execution trace (its "go 1.N trace" header) of the whole command.
func TestProfileFlags(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := t.TempDir()
	prof, tr := filepath.Join(dir, "cpu.pprof"), filepath.Join(dir, "exec.trace")
	e.OK("bench", "--duration", "2ms", "-e", "none", "-s", "512", "--cpuprofile", prof, "--trace", tr)
	for _, c := range []struct {
		path   string
		prefix string
	}{{prof, "\x1f\x8b"}, {tr, "go 1."}} {
		b, err := os.ReadFile(c.path)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(string(b), c.prefix) {
			t.Errorf("%s starts %q, want %q", filepath.Base(c.path), b[:min(len(b), 16)], c.prefix)
		}
	}
	e.Fails("--trace", "bench", "--duration", "2ms", "-e", "none", "--trace", filepath.Join(dir, "missing", "t"))
}

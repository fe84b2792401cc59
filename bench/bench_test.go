package main

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/sector"
)

// TestQuickRun runs the whole benchmark in quick mode (64 MiB, one repetition, 1 s fio
// runs) against every server, and checks that the table, the ratios, the chart and the
// JSON are complete. It takes about half a minute; -short skips it, and so does a
// machine without the tools, unless ELI_REQUIRE_TOOLS=1 or ELI_BENCH_SMOKE=1 make that a
// failure (ELI_BENCH_SMOKE=1 also runs it under -short).
func TestQuickRun(t *testing.T) {
	smoke := os.Getenv("ELI_BENCH_SMOKE") == "1"
	if testing.Short() && !smoke {
		t.Skip("-short: the quick benchmark takes about 30 s (ELI_BENCH_SMOKE=1 runs it anyway)")
	}
	for _, tool := range []struct{ prog, pkg string }{
		{"nbdkit", "nbdkit"}, {"nbdcopy", "libnbd-bin"}, {"nbdinfo", "libnbd-bin"}, {"fio", "fio"},
		{"qemu-nbd", "qemu-utils"}, {"cryptsetup", "cryptsetup-bin"},
	} {
		if _, err := exec.LookPath(tool.prog); err != nil && smoke {
			t.Fatalf("ELI_BENCH_SMOKE=1 but %s is missing (Debian package %s)", tool.prog, tool.pkg)
		}
		testtool.Need(t, tool.prog, tool.pkg)
	}
	dir := t.TempDir()
	work := "/dev/shm"
	if st, err := os.Stat(work); err != nil || !st.IsDir() {
		work = dir
	}
	md := filepath.Join(dir, "docs", "benchmarks.md")
	if err := os.MkdirAll(filepath.Dir(md), 0o755); err != nil {
		t.Fatal(err)
	}
	prose := "# Benchmarks\n\nProse before.\n\n" + markBegin + "\nold results\n" + markEnd + "\n\nProse after.\n"
	if err := os.WriteFile(md, []byte(prose), 0o644); err != nil {
		t.Fatal(err)
	}
	jsonPath := filepath.Join(dir, "results.json")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	start := time.Now()
	code := run(ctx, []string{"--quick", "--dir", work, "--out", md, "--json", jsonPath}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("bench --quick exited %d\nstderr:\n%s", code, stderr.String())
	}
	t.Logf("quick run took %v", time.Since(start).Round(time.Second))

	doc, err := os.ReadFile(md)
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	if !strings.HasPrefix(text, "# Benchmarks\n\nProse before.\n\n") || !strings.HasSuffix(text, markEnd+"\n\nProse after.\n") {
		t.Errorf("the prose around the markers changed:\n%s", text)
	}
	if strings.Contains(text, "old results") {
		t.Errorf("the old section is still there")
	}
	if !strings.Contains(stdout.String(), markBegin) {
		t.Errorf("the section was not printed")
	}
	checkTable(t, text, allTargets())
	checkColdWarm(t, text, allTargets())
	for _, want := range []string{"÷ qemu-nbd + LUKS", "÷ nbdkit luks", "÷ eli none", "Reproduce from the repository root: `bench/run --quick`",
		"nbdkit 1.", "fio-", "qemu-nbd ", "(benchmarks.svg)"} {
		if !strings.Contains(text, want) {
			t.Errorf("the section lacks %q", want)
		}
	}

	var rep report
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("results JSON: %v", err)
	}
	if rep.Machine.CPU == "" || rep.Machine.Cores < 1 || rep.Machine.Kernel == "" || rep.Size != 64<<20 || rep.Reps != 1 {
		t.Errorf("results JSON header: %+v", rep)
	}
	if len(rep.Results) != len(allTargets()) {
		t.Fatalf("%d results in the JSON, want %d", len(rep.Results), len(allTargets()))
	}
	for _, r := range rep.Results {
		if r.ExportSize < rep.Size {
			t.Errorf("%s exported %d bytes", r.Name, r.ExportSize)
		}
		for _, wl := range workloads() {
			if len(r.Rates[wl.Name]) != 1 || !(r.Rates[wl.Name][0] > 0) || !(r.Work[wl.Name] > 0) {
				t.Errorf("%s %s: rates %v, work %v", r.Name, wl.Name, r.Rates[wl.Name], r.Work[wl.Name])
			}
		}
	}
	if len(rep.Codecs) != 5 {
		t.Errorf("eli bench gave %d rows, want one per eli mode: %+v", len(rep.Codecs), rep.Codecs)
	}
	for _, c := range rep.Codecs {
		if c.SectorSize != 4096 || !(c.EncryptMBps > 0) || !(c.DecryptMBps > 0) || c.Threads < 1 {
			t.Errorf("eli bench row %+v", c)
		}
	}
	if !strings.Contains(text, "| xchacha20-poly1305 |") {
		t.Errorf("the section lacks the codec table")
	}
	checkChart(t, filepath.Join(dir, "docs", "benchmarks.svg"), allTargets())
}

// checkTable finds the results table and checks one row per target with four positive
// numbers.
func checkTable(t *testing.T, text string, targets []target) {
	t.Helper()
	checkRows(t, "results table", text, "| server | seq write MB/s |", targets, len(headline(workloads())))
}

// checkColdWarm finds the table of cold and warm sequential passes and checks one row
// per target with eight positive numbers.
func checkColdWarm(t *testing.T, text string, targets []target) {
	t.Helper()
	checkRows(t, "cold and warm table", text,
		"| server | seq write MB/s, cold | warm | seq read MB/s, cold | warm | seq write ms per GB, cold | warm | seq read ms per GB, cold | warm |",
		targets, 8)
}

// checkRows finds the table whose header starts with header and checks one row per
// target (by label, bold or not) with n positive numbers.
func checkRows(t *testing.T, what, text, header string, targets []target, n int) {
	t.Helper()
	rows := map[string][]string{}
	in := false
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, header) {
			in = true
			continue
		}
		if in && !strings.HasPrefix(l, "|") {
			break
		}
		if in && !strings.HasPrefix(l, "|---") {
			cells := strings.Split(strings.Trim(l, "|"), "|")
			rows[strings.Trim(strings.TrimSpace(cells[0]), "*")] = cells[1:]
		}
	}
	if len(rows) != len(targets) {
		t.Fatalf("%s has %d rows, want %d:\n%s", what, len(rows), len(targets), text)
	}
	for _, tg := range targets {
		cells, ok := rows[tg.Label]
		if !ok {
			t.Errorf("%s: no row for %s", what, tg.Label)
			continue
		}
		if len(cells) != n {
			t.Errorf("%s: %s: %d cells, want %d", what, tg.Label, len(cells), n)
		}
		for _, c := range cells {
			if x, err := strconv.ParseFloat(strings.TrimSpace(c), 64); err != nil || !(x > 0) {
				t.Errorf("%s: %s: cell %q is not a positive number", what, tg.Label, c)
			}
		}
	}
}

// checkChart parses the SVG and counts one bar per target and series, each with a width.
func checkChart(t *testing.T, path string, targets []target) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := xml.NewDecoder(f)
	bars := map[string]int{}
	inBar := false
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("chart is not well-formed XML: %v", err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			if el.Name.Local == "rect" {
				for _, a := range el.Attr {
					if a.Name.Local == "width" {
						if w, err := strconv.ParseFloat(a.Value, 64); err == nil && w > 0 {
							inBar = true
						}
					}
				}
			}
		case xml.CharData:
			if inBar {
				label, _, _ := strings.Cut(string(el), ":")
				bars[label]++
			}
		case xml.EndElement:
			if el.Name.Local == "rect" {
				inBar = false
			}
		}
	}
	for _, tg := range targets {
		for _, series := range []string{" write", " read"} {
			if n := bars[tg.Label+series]; n != 2 { // one per panel
				t.Errorf("chart has %d %q bars, want 2", n, tg.Label+series)
			}
		}
	}
}

// fakeReport builds a report with given medians (one repetition each).
func fakeReport(rates map[string][4]float64) *report {
	o := &options{size: 1 << 30, reps: 1, runtime: 10 * time.Second, args: []string{"--size", "1G"}}
	var ts []target
	for _, tg := range allTargets() {
		if _, ok := rates[tg.Name]; ok {
			ts = append(ts, tg)
		}
	}
	r := newReport(o, ts)
	for _, res := range r.Results {
		for i, wl := range headline(workloads()) {
			for _, name := range []string{wl.Name, warmOf(wl.Name)} {
				if name != "" {
					res.Rates[name] = []float64{rates[res.Name][i]}
					res.Work[name] = 1000
					res.CPUSeconds[name] = 1
				}
			}
		}
	}
	return r
}

func TestMissedTargets(t *testing.T) {
	t.Parallel()
	base := map[string][4]float64{
		nameQemuLUKS:   {300, 300, 20000, 20000},
		nameNbdkitLUKS: {250, 290, 30000, 30000},
		nameEliNone:    {1400, 1400, 60000, 60000},
	}
	tests := []struct {
		name string
		aead [4]float64
		want []string // substrings of the missed targets, in order
	}{
		{"all met", [4]float64{900, 900, 40000, 40000}, nil},
		{"seq write below 3x qemu", [4]float64{899, 900, 40000, 40000}, []string{"seq-write ÷ qemu-nbd + LUKS"}},
		{"random below 2x qemu", [4]float64{900, 900, 39999, 40000}, []string{"rand-read-4k ÷ qemu-nbd + LUKS"}},
		{"read below every seq target", [4]float64{900, 830, 40000, 40000},
			[]string{"seq-read ÷ qemu-nbd + LUKS", "seq-read ÷ nbdkit luks", "seq-read ÷ eli none"}},
		{"below 3x qemu and 0.6x none", [4]float64{839, 900, 40000, 40000}, []string{"seq-write ÷ qemu-nbd + LUKS", "seq-write ÷ eli none"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rates := map[string][4]float64{nameEliAEAD: tc.aead}
			for k, v := range base {
				rates[k] = v
			}
			got := fakeReport(rates).missedTargets()
			if len(got) != len(tc.want) {
				t.Fatalf("missed %q, want %d matching %q", got, len(tc.want), tc.want)
			}
			for i := range got {
				if !strings.HasPrefix(got[i], tc.want[i]) {
					t.Errorf("missed[%d] = %q, want prefix %q", i, got[i], tc.want[i])
				}
			}
		})
	}
	// Without the servers to compare with, nothing can be missed.
	if got := fakeReport(map[string][4]float64{nameEliAEAD: {1, 1, 1, 1}}).missedTargets(); len(got) != 0 {
		t.Errorf("missed %q with nothing to compare against", got)
	}
}

func TestMarkdownTableComplete(t *testing.T) {
	t.Parallel()
	rates := map[string][4]float64{}
	for i, tg := range allTargets() {
		x := float64(i + 1)
		rates[tg.Name] = [4]float64{100 * x, 110 * x, 1000 * x, 1100 * x}
	}
	r := fakeReport(rates)
	for _, res := range r.Results { // warm passes: twice the cold ones' MB/s at half the CPU
		for _, wl := range []string{wlSeqWriteWarm, wlSeqReadWarm} {
			res.Rates[wl][0] *= 2
			res.CPUSeconds[wl] /= 2
		}
	}
	text := r.markdown("benchmarks.svg")
	checkTable(t, text, allTargets())
	checkColdWarm(t, text, allTargets())
	// eli-none is the 4th target: cold write 400 MB/s, warm 800; read 440 and 880; CPU
	// 1 s per 1000 MB cold, half that warm.
	if !strings.Contains(text, "| eli none | 400 | 800 | 440 | 880 | 1000 | 500 | 1000 | 500 |") {
		t.Errorf("cold and warm row for eli none is wrong:\n%s", text)
	}
	if !strings.HasPrefix(text, markBegin+"\n") || !strings.HasSuffix(text, markEnd+"\n") {
		t.Errorf("section is not enclosed in its markers:\n%s", text)
	}
	// eli-xchacha20-poly1305 is the 5th target (x=5), qemu the 2nd (x=2): 2.50×.
	if !strings.Contains(text, "| ÷ qemu-nbd + LUKS | 2.50× (≥ 3×: **missed**) |") {
		t.Errorf("ratio row for qemu is wrong:\n%s", text)
	}
	if !strings.Contains(text, "Reproduce from the repository root: `bench/run --size 1G`") {
		t.Errorf("no reproduce line:\n%s", text)
	}
	dir := t.TempDir()
	svg := filepath.Join(dir, "c.svg")
	if err := os.WriteFile(svg, renderChart(r), 0o644); err != nil {
		t.Fatal(err)
	}
	checkChart(t, svg, allTargets())
}

func TestUpdateSection(t *testing.T) {
	t.Parallel()
	section := markBegin + "\nnew\n" + markEnd + "\n"
	tests := []struct {
		name, before, after string
		wantErr             string
	}{
		{"replaces between markers", "a\n" + markBegin + "\nold\n" + markEnd + "\nb\n", "a\n" + section + "b\n", ""},
		{"markers at the end", "a\n" + markBegin + "\n" + markEnd, "a\n" + section, ""},
		{"no markers", "just prose\n", "", "no " + markBegin},
		{"end before begin", markEnd + "\n" + markBegin + "\n", "", "no " + markBegin},
		{"two sections", markBegin + markEnd + "\n" + markBegin + markEnd + "\n", "", "more than one"},
		{"new file", "", "# Benchmarks\n\n" + section, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "b.md")
			if tc.before != "" {
				if err := os.WriteFile(path, []byte(tc.before), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			err := updateSection(path, section)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				if got, _ := os.ReadFile(path); string(got) != tc.before {
					t.Errorf("a refused update changed the file to %q", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got, _ := os.ReadFile(path); string(got) != tc.after {
				t.Errorf("got %q, want %q", got, tc.after)
			}
		})
	}
}

func TestParseOptions(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args    []string
		size    int64
		reps    int
		runtime time.Duration
		targets int
		wantErr string
	}{
		{nil, 1 << 30, 5, 5 * time.Second, 8, ""},
		{[]string{"--quick"}, 64 << 20, 1, time.Second, 8, ""},
		{[]string{"--quick", "--reps", "3"}, 64 << 20, 3, time.Second, 8, ""},
		{[]string{"--size", "64M", "--reps", "1"}, 64 << 20, 1, time.Second, 8, ""},
		{[]string{"--size", "512MiB", "--runtime", "10s"}, 512 << 20, 5, 10 * time.Second, 8, ""},
		{[]string{"--targets", "eli-none, nbdkit-file"}, 1 << 30, 5, 5 * time.Second, 2, ""},
		{[]string{"--size", "1000"}, 0, 0, 0, 0, "whole number of MiB"},
		{[]string{"--size", "1T"}, 0, 0, 0, 0, "not a size"},
		{[]string{"--reps", "0"}, 0, 0, 0, 0, "--reps"},
		{[]string{"--runtime", "10ms"}, 0, 0, 0, 0, "--runtime"},
		{[]string{"--targets", "dm-crypt"}, 0, 0, 0, 0, "unknown server"},
		{[]string{"--targets", ","}, 0, 0, 0, 0, "at least one"},
		{[]string{"stray"}, 0, 0, 0, 0, "unexpected argument"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			o, err := parseOptions(tc.args, io.Discard)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if o.size != tc.size || o.reps != tc.reps || o.runtime != tc.runtime || len(o.targets) != tc.targets {
				t.Errorf("got size %d reps %d runtime %v targets %v", o.size, o.reps, o.runtime, o.targets)
			}
		})
	}
}

func TestRunUsageExitCodes(t *testing.T) {
	t.Parallel()
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"-h"}, &out, &errb); code != 0 || !strings.Contains(errb.String(), "usage: bench/run") {
		t.Errorf("-h: exit %d, %q", code, errb.String())
	}
	errb.Reset()
	if code := run(context.Background(), []string{"--reps", "x"}, &out, &errb); code != 2 {
		t.Errorf("bad flag: exit %d, %q", code, errb.String())
	}
}

func TestEliProviderSize(t *testing.T) {
	t.Parallel()
	for _, m := range []sector.Mode{sector.ModeNone, sector.ModeXChaCha20Poly1305, sector.ModeAESXTS256} {
		for _, size := range []int64{16 << 20, 64 << 20, 1 << 30} {
			p, err := eliProviderSize(size, m)
			if err != nil {
				t.Fatalf("%s %d: %v", m, size, err)
			}
			if p < size || p%(64<<10) != 0 {
				t.Errorf("%s %d: provider %d", m, size, p)
			}
			// Overhead: at most the journal, metadata (1 in 103) and alignment.
			if over := float64(p-size) / float64(size); over > 0.011+float64(4<<20)/float64(size) {
				t.Errorf("%s %d: provider %d is %.1f%% larger than needed", m, size, p, 100*over)
			}
		}
	}
}

func TestReproduceCommand(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want string
	}{
		{nil, "bench/run"},
		{[]string{"--size", "1G", "--reps", "5"}, "bench/run --size 1G --reps 5"},
		{[]string{"--eli", "/tmp/x/eli", "--out=docs/b.md", "--json", "r.json", "--keep", "-check", "--quick"}, "bench/run --quick"},
		{[]string{"--targets", "eli-none,nbdkit-file", "--dir", "/mnt/ram"}, "bench/run --targets eli-none,nbdkit-file"},
		{[]string{"--out", ""}, "bench/run"},
	}
	for _, tc := range tests {
		if got := reproduceCommand(&options{args: tc.args}); got != tc.want {
			t.Errorf("%q: got %q, want %q", tc.args, got, tc.want)
		}
	}
}

func TestNiceStep(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want float64 }{{0, 1}, {0.3, 0.5}, {1, 1}, {1.1, 2}, {240, 500}, {4999, 5000}, {5001, 10000}} {
		if got := niceStep(tc.in); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("niceStep(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

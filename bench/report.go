package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// report is everything one run measured.
type report struct {
	Started   string          `json:"started"`
	Finished  string          `json:"finished"`
	Command   string          `json:"command"`
	Size      int64           `json:"size"`
	Reps      int             `json:"reps"`
	RuntimeS  float64         `json:"fio_runtime_s"`
	Machine   machine         `json:"machine"`
	Workloads []workload      `json:"workloads"`
	Results   []*targetResult `json:"results"`
	Codecs    []codecResult   `json:"codecs,omitempty"` // eli bench, same machine, same run
}

// codecResult is one row of eli bench --json.
type codecResult struct {
	Mode        string  `json:"mode"`
	SectorSize  int     `json:"sector_size"`
	EncryptMBps float64 `json:"encrypt_mbps"`
	DecryptMBps float64 `json:"decrypt_mbps"`
	Threads     int     `json:"threads"`
}

// targetResult is one server's measurements: per workload, one rate per repetition, and
// the server's CPU time and work done summed over the repetitions.
type targetResult struct {
	target
	ExportSize int64                `json:"export_size"`
	Warmup     map[string]float64   `json:"warmup"`
	Rates      map[string][]float64 `json:"rates"`
	CPUSeconds map[string]float64   `json:"cpu_seconds"`
	Work       map[string]float64   `json:"work"`
}

func newReport(o *options, ts []target) *report {
	r := &report{
		Started:   time.Now().UTC().Format(time.RFC3339),
		Command:   reproduceCommand(o),
		Size:      o.size,
		Reps:      o.reps,
		RuntimeS:  o.runtime.Seconds(),
		Workloads: workloads(),
	}
	for _, t := range ts {
		r.Results = append(r.Results, &targetResult{
			target: t, Warmup: map[string]float64{}, Rates: map[string][]float64{},
			CPUSeconds: map[string]float64{}, Work: map[string]float64{},
		})
	}
	return r
}

// reproduceCommand is the command line, minus the options that only say where output
// goes or which binary to use, which another machine would not share.
func reproduceCommand(o *options) string {
	drop := map[string]bool{"out": true, "json": true, "chart": true, "eli": true, "dir": true} // take a value
	flags := map[string]bool{"keep": true, "check": true}                                       // do not
	parts := []string{"bench/run"}
	for k := 0; k < len(o.args); k++ {
		a := o.args[k]
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && (drop[name] || flags[name]) {
			if drop[name] && !hasValue {
				k++ // its value
			}
			continue
		}
		parts = append(parts, shellQuote(a))
	}
	return strings.Join(parts, " ")
}

func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,/:") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func (r *report) result(name string) *targetResult {
	for _, t := range r.Results {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// median of a workload's rates (NaN without any).
func (t *targetResult) median(wl string) float64 {
	v := append([]float64(nil), t.Rates[wl]...)
	if len(v) == 0 {
		return math.NaN()
	}
	sort.Float64s(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// cpuPer is the server's CPU time per unit of work: ms per GB for sequential workloads,
// µs per I/O for random ones.
func (t *targetResult) cpuPer(wl workload) float64 {
	w := t.Work[wl.Name]
	if w == 0 {
		return math.NaN()
	}
	if wl.Work == "MB" {
		return t.CPUSeconds[wl.Name] * 1e3 / (w / 1e3)
	}
	return t.CPUSeconds[wl.Name] * 1e6 / w
}

// ratioTarget is one of issue 7's targets: eli xchacha20-poly1305 against another server.
type ratioTarget struct {
	against string
	label   string
	min     map[string]float64 // workload -> least acceptable ratio (absent: no target)
}

func ratioTargets() []ratioTarget {
	return []ratioTarget{
		{nameQemuLUKS, "÷ qemu-nbd + LUKS", map[string]float64{wlSeqWrite: 3, wlSeqRead: 3, wlRandRead: 2, wlRandWrite: 2}},
		{nameNbdkitLUKS, "÷ nbdkit luks", map[string]float64{wlSeqWrite: 3, wlSeqRead: 3}},
		{nameEliNone, "÷ eli none", map[string]float64{wlSeqWrite: 0.6, wlSeqRead: 0.6}},
	}
}

// ratio of eli xchacha20-poly1305's median to against's (NaN if either is missing).
func (r *report) ratio(against, wl string) float64 {
	a, b := r.result(nameEliAEAD), r.result(against)
	if a == nil || b == nil {
		return math.NaN()
	}
	return a.median(wl) / b.median(wl)
}

// missedTargets lists the targets this run could check and eli missed.
func (r *report) missedTargets() []string {
	var missed []string
	for _, rt := range ratioTargets() {
		for _, wl := range r.Workloads {
			min, ok := rt.min[wl.Name]
			x := r.ratio(rt.against, wl.Name)
			if ok && !math.IsNaN(x) && x < min {
				missed = append(missed, fmt.Sprintf("%s %s %.2f× < %g×", wl.Name, rt.label, x, min))
			}
		}
	}
	return missed
}

// Markers around the generated part of docs/benchmarks.md.
const (
	markBegin = "<!-- bench:begin -->"
	markEnd   = "<!-- bench:end -->"
)

func workloadTitle(wl workload) string {
	switch wl.Name {
	case wlSeqWrite:
		return "seq write MB/s"
	case wlSeqRead:
		return "seq read MB/s"
	case wlRandRead:
		return "rand read 4K IOPS"
	case wlRandWrite:
		return "rand write 4K IOPS"
	case wlSeqWriteWarm:
		return "seq write (warm) MB/s"
	case wlSeqReadWarm:
		return "seq read (warm) MB/s"
	}
	return wl.Name + " " + wl.Unit
}

// markdown renders the generated section, markers included. chartRef is the chart's path
// relative to the Markdown file ("" for no chart).
func (r *report) markdown(chartRef string) string {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	m := r.Machine
	p("%s\n\n", markBegin)
	p("<!-- Written by bench/run; edits between these markers are lost on the next run. -->\n\n")
	p("Measured %s, eli %s, on %s (%d cores), %.1f GiB RAM, Linux %s, %s; ",
		dateOf(r.Started), orUnknown(m.Eli), m.CPU, m.Cores, float64(m.MemoryMiB)/1024, m.Kernel, strings.TrimPrefix(m.Go, "go version "))
	var tools []string
	for _, k := range []string{"nbdkit", "libnbd", "fio", "qemu-nbd", "cryptsetup"} {
		if v := m.Tools[k]; v != "" {
			tools = append(tools, v)
		}
	}
	p("%s. One-minute load average %.2f before the run", strings.Join(tools, ", "), m.LoadStart)
	if m.LoadStart > 1 {
		p(" (other work was running: figures taken under load)")
	}
	p(", %.2f at its end (the run itself keeps both client and server busy).\n\n", m.LoadEnd)
	p("Each export holds %s on tmpfs; %d measured repetition(s) after one warm-up pass, medians; fio ran %gs per run. "+
		"The sequential figures are a fresh server's: each repetition starts every server again before its sequential write and before its sequential read, "+
		"as a user's first copy, scan or backup after attach meets it (the same pass again on the same server is in the table of cold and warm figures below).\n\n",
		sizeString(r.Size), r.Reps, r.RuntimeS)
	wls := headline(r.Workloads)

	p("| server |")
	for _, wl := range wls {
		p(" %s |", workloadTitle(wl))
	}
	p("\n|---|")
	for range wls {
		p("---:|")
	}
	p("\n")
	for _, t := range r.Results {
		name := t.Label
		if t.Name == nameEliAEAD {
			name = "**" + name + "**"
		}
		p("| %s |", name)
		for _, wl := range wls {
			p(" %s |", number(t.median(wl.Name)))
		}
		p("\n")
	}
	if chartRef != "" {
		p("\n![Sequential MB/s and random 4 KiB IOPS of every server](%s)\n", chartRef)
	}

	if r.result(nameEliAEAD) != nil {
		p("\neli xchacha20-poly1305 against the others, as ratios of medians from this run (targets in brackets):\n\n")
		p("| eli xchacha20-poly1305 |")
		for _, wl := range wls {
			p(" %s |", strings.TrimSuffix(strings.TrimSuffix(workloadTitle(wl), " MB/s"), " IOPS"))
		}
		p("\n|---|")
		for range wls {
			p("---:|")
		}
		p("\n")
		for _, rt := range ratioTargets() {
			if r.result(rt.against) == nil {
				continue
			}
			p("| %s |", rt.label)
			for _, wl := range wls {
				x := r.ratio(rt.against, wl.Name)
				cell := fmt.Sprintf("%.2f×", x)
				if min, ok := rt.min[wl.Name]; ok {
					mark := "met"
					if !(x >= min) {
						mark = "**missed**"
					}
					cell += fmt.Sprintf(" (≥ %g×: %s)", min, mark)
				}
				p(" %s |", cell)
			}
			p("\n")
		}
	}

	p("\nServer CPU time per unit of work, summed over the repetitions (lower is better; steadier than throughput on a shared machine):\n\n")
	p("| server |")
	for _, wl := range wls {
		unit := "µs per I/O"
		if wl.Work == "MB" {
			unit = "ms per GB"
		}
		p(" %s, %s |", strings.Fields(workloadTitle(wl))[0]+" "+strings.Fields(workloadTitle(wl))[1], unit)
	}
	p("\n|---|")
	for range wls {
		p("---:|")
	}
	p("\n")
	for _, t := range r.Results {
		p("| %s |", t.Label)
		for _, wl := range wls {
			p(" %s |", number(t.cpuPer(wl)))
		}
		p("\n")
	}
	if cw := r.coldWarm(); cw != "" {
		p("\n%s", cw)
	}
	if len(r.Codecs) > 0 {
		p("\nThe codecs alone (`eli bench --sector-size 4096`, %d threads, in memory, no I/O), the ceiling each eli mode sets:\n\n", r.Codecs[0].Threads)
		p("| mode | encrypt MB/s | decrypt MB/s |\n|---|---:|---:|\n")
		for _, c := range r.Codecs {
			p("| %s | %s | %s |\n", c.Mode, number(c.EncryptMBps), number(c.DecryptMBps))
		}
	}
	p("\nReproduce from the repository root: `%s`\n\n", r.Command)
	p("%s\n", markEnd)
	return b.String()
}

// coldWarm renders the table of the sequential workloads on a fresh server and again on
// the same one, throughput and server CPU side by side ("" if the run has none).
func (r *report) coldWarm() string {
	var pairs []workload
	for _, wl := range r.Workloads {
		if wl.Fresh && warmOf(wl.Name) != "" {
			pairs = append(pairs, wl)
		}
	}
	if len(pairs) == 0 {
		return ""
	}
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	p("Sequential passes on a fresh server (cold) and the same pass again on the same server (warm), medians of MB/s and server CPU per GB summed over the repetitions:\n\n")
	p("| server |")
	for _, wl := range pairs {
		what := strings.TrimSuffix(workloadTitle(wl), " MB/s")
		p(" %s MB/s, cold | warm |", what)
	}
	for _, wl := range pairs {
		what := strings.TrimSuffix(workloadTitle(wl), " MB/s")
		p(" %s ms per GB, cold | warm |", what)
	}
	p("\n|---|")
	for range 2 * len(pairs) {
		p("---:|---:|")
	}
	p("\n")
	byName := map[string]workload{}
	for _, wl := range r.Workloads {
		byName[wl.Name] = wl
	}
	for _, t := range r.Results {
		p("| %s |", t.Label)
		for _, wl := range pairs {
			p(" %s | %s |", number(t.median(wl.Name)), number(t.median(warmOf(wl.Name))))
		}
		for _, wl := range pairs {
			p(" %s | %s |", number(t.cpuPer(wl)), number(t.cpuPer(byName[warmOf(wl.Name)])))
		}
		p("\n")
	}
	return b.String()
}

func dateOf(rfc3339 string) string {
	d, _, _ := strings.Cut(rfc3339, "T")
	return d
}

func orUnknown(s string) string {
	if s == "" {
		return "(unknown commit)"
	}
	return s
}

func sizeString(n int64) string {
	if n%(1<<30) == 0 {
		return fmt.Sprintf("%d GiB", n>>30)
	}
	return fmt.Sprintf("%d MiB", n>>20)
}

// number formats a rate or cost for a table: three significant figures, at least the
// units digit.
func number(x float64) string {
	switch {
	case math.IsNaN(x) || math.IsInf(x, 0):
		return "–"
	case x >= 100:
		return fmt.Sprintf("%.0f", x)
	case x >= 10:
		return fmt.Sprintf("%.1f", x)
	default:
		return fmt.Sprintf("%.2f", x)
	}
}

// writeOutputs prints the section, writes the JSON, the chart and the Markdown file.
func writeOutputs(o *options, r *report, stdout io.Writer) error {
	for _, p := range []string{o.chart, o.jsonOut, o.out} {
		if p != "" {
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
		}
	}
	chartRef := ""
	if o.chart != "" {
		if err := os.WriteFile(o.chart, renderChart(r), 0o644); err != nil {
			return fmt.Errorf("write the chart: %w", err)
		}
		chartRef = o.chart
		if o.out != "" {
			if rel, err := filepath.Rel(filepath.Dir(o.out), o.chart); err == nil {
				chartRef = rel
			}
		}
	}
	section := r.markdown(chartRef)
	fmt.Fprint(stdout, section)
	if o.jsonOut != "" {
		b, err := json.MarshalIndent(r, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(o.jsonOut, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write %s: %w", o.jsonOut, err)
		}
	}
	if o.out != "" {
		if err := updateSection(o.out, section); err != nil {
			return err
		}
	}
	return nil
}

// updateSection replaces the text between the markers of the Markdown file at path (the
// markers included) with section, leaving the rest as it was. A file that does not exist
// is created from a skeleton; one without both markers is refused rather than clobbered.
func updateSection(path, section string) error {
	old, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		old = []byte(skeleton)
	} else if err != nil {
		return err
	}
	text := string(old)
	i := strings.Index(text, markBegin)
	j := strings.Index(text, markEnd)
	if i < 0 || j < i {
		return fmt.Errorf("%s has no %s … %s section to replace: add the two markers where the results belong", path, markBegin, markEnd)
	}
	if strings.Contains(text[j+len(markEnd):], markBegin) {
		return fmt.Errorf("%s has more than one bench section", path)
	}
	j += len(markEnd)
	if j < len(text) && text[j] == '\n' {
		j++
	}
	out := text[:i] + section + text[j:]
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(out), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

const skeleton = `# Benchmarks

` + markBegin + `
` + markEnd + `
`

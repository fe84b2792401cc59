package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// measureAll sets every server up, warms each up, runs the repetitions and tears down.
func measureAll(ctx context.Context, o *options, log io.Writer) (*report, error) {
	var targets []target
	for _, n := range o.targets {
		targets = append(targets, targetByName(n))
	}
	if err := checkTools(targets); err != nil {
		return nil, err
	}
	if err := checkMemory(o.dir, int64(len(targets)+1)*o.size); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(o.dir, "eli-bench-")
	if err != nil {
		return nil, fmt.Errorf("working directory: %w (give --dir a tmpfs you can write)", err)
	}
	if o.keep {
		fmt.Fprintf(log, "working directory (kept): %s\n", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	w := &world{dir: dir, size: o.size, eli: o.eli, passFile: filepath.Join(dir, "passphrase"), logDir: filepath.Join(dir, "logs")}
	if err := os.MkdirAll(w.logDir, 0o700); err != nil {
		return nil, err
	}
	// No newline: cryptsetup and qemu take a key file's every byte.
	if err := os.WriteFile(w.passFile, []byte("eli-bench-not-a-secret"), 0o600); err != nil {
		return nil, err
	}
	if w.eli == "" && hasEli(targets) {
		if w.eli, err = buildEli(ctx, dir); err != nil {
			return nil, err
		}
	}
	rep := newReport(o, targets)
	rep.Machine = describeMachine(ctx, w.eli)
	if w.eli != "" {
		// The codecs' ceiling on this machine, before any server runs.
		d := "500ms"
		if o.size < 256<<20 {
			d = "50ms"
		}
		if rep.Codecs, err = codecBench(ctx, w.eli, d, targets); err != nil {
			return nil, err
		}
	}

	r := &runner{src: filepath.Join(dir, "source.img"), size: o.size, runtime: o.runtime}
	if err := writeRandom(r.src, o.size); err != nil {
		return nil, err
	}

	servers := make([]*server, 0, len(targets))
	defer func() {
		for _, s := range servers {
			if err := s.stop(); err != nil {
				fmt.Fprintf(log, "bench: %v\n", err)
			}
		}
	}()
	for _, t := range targets {
		fmt.Fprintf(log, "starting %s\n", t.Name)
		s, err := w.start(ctx, t)
		if err != nil {
			return nil, err
		}
		servers = append(servers, s)
		rep.result(t.Name).ExportSize = s.size
	}

	wls := workloads()
	for _, s := range servers {
		for _, wl := range []workload{wls[0], wls[2]} { // one sequential write and read pass
			rate, _, err := wl.run(r, ctx, s)
			if err != nil {
				return nil, fmt.Errorf("warm-up: %w", err)
			}
			rep.result(s.t.Name).Warmup[wl.Name] = rate
			fmt.Fprintf(log, "warm-up %-24s %-14s %8.0f %s\n", s.t.Name, wl.Name, rate, wl.Unit)
		}
	}
	for rep_ := range o.reps {
		for _, wl := range wls {
			for k := range servers {
				i := (k + rep_) % len(servers)
				if wl.Fresh {
					s, err := w.restart(ctx, servers[i])
					if err != nil {
						servers = append(servers[:i], servers[i+1:]...) // stopped
						return nil, err
					}
					servers[i] = s
				}
				s := servers[i]
				before, err := s.cpuTime()
				if err != nil {
					return nil, err
				}
				rate, work, err := wl.run(r, ctx, s)
				if err != nil {
					return nil, err
				}
				after, err := s.cpuTime()
				if err != nil {
					return nil, err
				}
				tr := rep.result(s.t.Name)
				tr.Rates[wl.Name] = append(tr.Rates[wl.Name], rate)
				tr.CPUSeconds[wl.Name] += (after - before).Seconds()
				tr.Work[wl.Name] += work
				fmt.Fprintf(log, "rep %d/%d %-24s %-14s %8.0f %s\n", rep_+1, o.reps, s.t.Name, wl.Name, rate, wl.Unit)
			}
		}
	}
	rep.Machine.LoadEnd = loadAverage()
	rep.Finished = time.Now().UTC().Format(time.RFC3339)
	return rep, nil
}

func hasEli(ts []target) bool {
	for _, t := range ts {
		if t.kind == kindEli {
			return true
		}
	}
	return false
}

// checkTools names every missing program at once, with the package that provides it.
func checkTools(ts []target) error {
	need := map[string]string{"nbdcopy": "libnbd-bin", "nbdinfo": "libnbd-bin", "fio": "fio"}
	for _, t := range ts {
		switch t.kind {
		case kindNbdkitFile:
			need["nbdkit"] = "nbdkit"
		case kindQemuLUKS:
			need["qemu-nbd"], need["cryptsetup"] = "qemu-utils", "cryptsetup-bin"
		case kindNbdkitLUKS:
			need["nbdkit"], need["cryptsetup"] = "nbdkit", "cryptsetup-bin"
		case kindEli:
			need["go"] = "golang (to build eli; or give --eli)"
		}
	}
	var missing []string
	for prog, pkg := range need {
		if _, err := exec.LookPath(prog); err != nil {
			missing = append(missing, fmt.Sprintf("%s (%s)", prog, pkg))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing programs: %s", strings.Join(missing, ", "))
	}
	if err := exec.Command("fio", "--enghelp=nbd").Run(); err != nil {
		return fmt.Errorf("fio lacks the nbd engine (fio --enghelp=nbd: %v)", err)
	}
	for _, t := range ts {
		if t.kind == kindNbdkitLUKS {
			if err := exec.Command("nbdkit", "--filter=luks", "null", "--dump-plugin").Run(); err != nil {
				return fmt.Errorf("nbdkit has no luks filter (nbdkit --filter=luks null --dump-plugin: %v)", err)
			}
			break
		}
	}
	return nil
}

// checkMemory refuses a run whose files would not fit in memory beside what is used.
func checkMemory(dir string, need int64) error {
	avail := memAvailable()
	if avail > 0 && need > avail*9/10 {
		return fmt.Errorf("the run needs about %d MiB on %s but only %d MiB of memory is available: lower --size or --targets",
			need>>20, dir, avail>>20)
	}
	return nil
}

// buildEli builds the eli binary from this source tree.
func buildEli(ctx context.Context, dir string) (string, error) {
	gomod, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil || strings.TrimSpace(string(gomod)) == "" || strings.TrimSpace(string(gomod)) == os.DevNull {
		return "", fmt.Errorf("find the eli module (run from its source tree, or give --eli): %v", err)
	}
	root := filepath.Dir(strings.TrimSpace(string(gomod)))
	bin := filepath.Join(dir, "eli")
	desc := exec.CommandContext(ctx, "git", "describe", "--always", "--dirty")
	desc.Dir = root
	version, _ := desc.Output()
	args := []string{"build", "-o", bin}
	if v := strings.TrimSpace(string(version)); v != "" {
		args = append(args, "-ldflags", "-X main.version="+v)
	}
	cmd := exec.CommandContext(ctx, "go", append(args, "./cmd/eli")...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build eli: %w\n%s", err, out)
	}
	return bin, nil
}

// writeRandom writes size random bytes: no client or server can skip or compress them.
func writeRandom(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for n := int64(0); n < size; n += int64(len(buf)) {
		b := buf[:min(int64(len(buf)), size-n)]
		rand.Read(b)
		if _, err := f.Write(b); err != nil {
			f.Close()
			return fmt.Errorf("write the source file: %w", err)
		}
	}
	return f.Close()
}

// codecBench runs eli bench for the eli targets' modes at 4096-byte sectors (the sector
// size the eli volumes here use).
func codecBench(ctx context.Context, eli, duration string, ts []target) ([]codecResult, error) {
	args := []string{"bench", "--json", "--sector-size", "4096", "--duration", duration}
	for _, t := range ts {
		if t.kind == kindEli {
			args = append(args, "--cipher", t.mode.String())
		}
	}
	out, err := exec.CommandContext(ctx, eli, args...).Output()
	if err != nil {
		return nil, fmt.Errorf("eli %s: %w", strings.Join(args, " "), err)
	}
	var res struct {
		Threads int           `json:"threads"`
		Results []codecResult `json:"results"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return nil, fmt.Errorf("eli bench --json: %w", err)
	}
	for i := range res.Results {
		res.Results[i].Threads = res.Threads
	}
	return res.Results, nil
}

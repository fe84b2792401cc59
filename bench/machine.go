package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"
)

// machine describes where the figures were taken.
type machine struct {
	CPU       string            `json:"cpu"`
	Cores     int               `json:"cores"`
	MemoryMiB int64             `json:"memory_mib"`
	Kernel    string            `json:"kernel"`
	Go        string            `json:"go"`
	Eli       string            `json:"eli"` // the measured binary's version (git describe when bench/run builds it)
	Tools     map[string]string `json:"tools"`
	LoadStart float64           `json:"load_start"` // 1-minute load average
	LoadEnd   float64           `json:"load_end"`
}

func describeMachine(ctx context.Context, eliBin string) machine {
	m := machine{
		CPU:       lscpuModel(ctx),
		Cores:     runtime.NumCPU(),
		MemoryMiB: memInfo("MemTotal") >> 20,
		Kernel:    strings.TrimSpace(readFile("/proc/sys/kernel/osrelease")),
		Go:        firstLine(command(ctx, "go", "version")),
		Eli:       eliVersion(ctx, eliBin),
		Tools:     map[string]string{},
		LoadStart: loadAverage(),
	}
	if m.Go == "" {
		m.Go = runtime.Version()
	}
	for name, argv := range map[string][]string{
		"nbdkit":     {"nbdkit", "--version"},
		"libnbd":     {"nbdcopy", "--version"}, // "nbdcopy 1.x" then "libnbd 1.x"
		"fio":        {"fio", "--version"},
		"qemu-nbd":   {"qemu-nbd", "--version"},
		"cryptsetup": {"cryptsetup", "--version"},
	} {
		out := command(ctx, argv[0], argv[1:]...)
		if name == "libnbd" {
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "libnbd ") {
					out = l
				}
			}
		}
		out, _, _ = strings.Cut(out, " flags:") // cryptsetup lists its build flags
		if v := firstLine(out); v != "" {
			m.Tools[name] = v
		}
	}
	return m
}

// eliVersion is what the measured binary says it is ("eli VERSION (...)"): bench/run
// builds it with the tree's git describe; a binary given with --eli tells its own.
func eliVersion(ctx context.Context, bin string) string {
	if bin == "" {
		return ""
	}
	v := strings.TrimPrefix(firstLine(command(ctx, bin, "version")), "eli ")
	v, _, _ = strings.Cut(v, " (")
	return v
}

func command(ctx context.Context, name string, args ...string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).Output()
	if err != nil {
		return ""
	}
	return string(out)
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(s)
}

func readFile(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

func lscpuModel(ctx context.Context) string {
	for _, l := range strings.Split(command(ctx, "lscpu"), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "Model name" {
			return strings.TrimSpace(v)
		}
	}
	return runtime.GOARCH
}

// memInfo returns a /proc/meminfo field in bytes (0 if unknown).
func memInfo(field string) int64 {
	sc := bufio.NewScanner(bytes.NewReader([]byte(readFile("/proc/meminfo"))))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || k != field {
			continue
		}
		var kb int64
		if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err == nil {
			return kb << 10
		}
	}
	return 0
}

func memAvailable() int64 { return memInfo("MemAvailable") }

// loadAverage is the 1-minute load average (0 if unknown).
func loadAverage() float64 {
	var l float64
	fmt.Sscan(readFile("/proc/loadavg"), &l)
	return l
}

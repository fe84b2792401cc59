package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// workload is one client run against one server.
type workload struct {
	Name string `json:"name"`
	Unit string `json:"unit"` // "MB/s" (10^6 bytes per second) or "IOPS"
	// Work is what the CPU time is divided by: "MB" or "I/O".
	Work string `json:"work"`
	// Fresh: run on a server started just before (what a user meets after attach:
	// nothing read, no memory of its own touched yet); the -warm workload after it
	// repeats it on the same server.
	Fresh bool `json:"fresh,omitempty"`
	// Warm: the repetition of a Fresh workload, on the server it left behind.
	Warm bool `json:"warm,omitempty"`
	run  func(r *runner, ctx context.Context, s *server) (rate, work float64, err error)
}

const (
	wlSeqWrite     = "seq-write"
	wlSeqWriteWarm = "seq-write-warm"
	wlSeqRead      = "seq-read"
	wlSeqReadWarm  = "seq-read-warm"
	wlRandRead     = "rand-read-4k"
	wlRandWrite    = "rand-write-4k"
)

// workloads in the order each repetition runs them. The sequential ones run twice on
// each server: on one started afresh, then again on the same one.
func workloads() []workload {
	return []workload{
		{Name: wlSeqWrite, Unit: "MB/s", Work: "MB", Fresh: true, run: (*runner).seqWrite},
		{Name: wlSeqWriteWarm, Unit: "MB/s", Work: "MB", Warm: true, run: (*runner).seqWrite},
		{Name: wlSeqRead, Unit: "MB/s", Work: "MB", Fresh: true, run: (*runner).seqRead},
		{Name: wlSeqReadWarm, Unit: "MB/s", Work: "MB", Warm: true, run: (*runner).seqRead},
		{Name: wlRandRead, Unit: "IOPS", Work: "I/O", run: func(r *runner, ctx context.Context, s *server) (float64, float64, error) {
			return r.fio(ctx, s, "randread")
		}},
		{Name: wlRandWrite, Unit: "IOPS", Work: "I/O", run: func(r *runner, ctx context.Context, s *server) (float64, float64, error) {
			return r.fio(ctx, s, "randwrite")
		}},
	}
}

// headline are the workloads of the main tables and the chart: the sequential ones on
// a fresh server, which is what a user's first copy, scan or backup after attach meets.
func headline(wls []workload) []workload {
	var h []workload
	for _, wl := range wls {
		if !wl.Warm {
			h = append(h, wl)
		}
	}
	return h
}

// warmOf is the Warm workload that repeats wl, or "".
func warmOf(wl string) string {
	switch wl {
	case wlSeqWrite:
		return wlSeqWriteWarm
	case wlSeqRead:
		return wlSeqReadWarm
	}
	return ""
}

// runner holds what the clients need.
type runner struct {
	src     string // a file of random bytes, --size long
	size    int64
	runtime time.Duration
}

// seqWrite copies the source file onto the export. --flush makes the copy end with a
// flush, so that a server that defers work (eli's write batches, a page cache) pays for
// it inside the measured time.
func (r *runner) seqWrite(ctx context.Context, s *server) (float64, float64, error) {
	secs, err := r.timed(ctx, "nbdcopy", "--flush", r.src, s.uri)
	if err != nil {
		return 0, 0, err
	}
	mb := float64(r.size) / 1e6
	return mb / secs, mb, nil
}

// seqRead reads the whole export. --no-extents: every byte is read, whatever the server
// says is allocated.
func (r *runner) seqRead(ctx context.Context, s *server) (float64, float64, error) {
	secs, err := r.timed(ctx, "nbdcopy", "--no-extents", s.uri, "null:")
	if err != nil {
		return 0, 0, err
	}
	mb := float64(s.size) / 1e6
	return mb / secs, mb, nil
}

func (r *runner) timed(ctx context.Context, name string, args ...string) (float64, error) {
	// Generous: 20 MB/s would be a broken server, not a slow one.
	limit := 2*time.Minute + time.Duration(r.size/20e6)*time.Second
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	secs := time.Since(start).Seconds()
	if err != nil {
		return 0, fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return secs, nil
}

// fio runs 4 KiB random I/O at queue depth 32 on one connection for r.runtime and returns
// IOPS and the number of I/Os done.
func (r *runner) fio(ctx context.Context, s *server, rw string) (float64, float64, error) {
	ramp := time.Duration(0)
	if r.runtime >= 5*time.Second {
		ramp = time.Second
	}
	args := []string{"--name=bench", "--ioengine=nbd", "--uri=" + s.uri, "--rw=" + rw, "--bs=4k",
		"--iodepth=32", "--numjobs=1", "--size=" + strconv.FormatInt(r.size, 10), "--time_based",
		"--runtime=" + strconv.FormatInt(int64(r.runtime/time.Millisecond), 10) + "ms",
		"--ramp_time=" + strconv.FormatInt(int64(ramp/time.Millisecond), 10) + "ms",
		"--output-format=json"}
	ctx, cancel := context.WithTimeout(ctx, r.runtime+ramp+time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "fio", args...).Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		return 0, 0, fmt.Errorf("fio %s on %s: %w\n%s%s", rw, s.t.Name, err, out, msg)
	}
	return parseFio(out)
}

// parseFio reads the IOPS and I/O count of fio's one job. fio may print notices before
// its JSON document.
func parseFio(out []byte) (float64, float64, error) {
	i := strings.IndexByte(string(out), '{')
	if i < 0 {
		return 0, 0, fmt.Errorf("fio printed no JSON: %q", out)
	}
	var res struct {
		Jobs []struct {
			Error       int `json:"error"`
			Read, Write struct {
				IOPS     float64 `json:"iops"`
				TotalIOs float64 `json:"total_ios"`
			}
		} `json:"jobs"`
	}
	if err := json.Unmarshal(out[i:], &res); err != nil {
		return 0, 0, fmt.Errorf("fio's JSON: %w", err)
	}
	if len(res.Jobs) != 1 {
		return 0, 0, fmt.Errorf("fio reported %d jobs, want 1", len(res.Jobs))
	}
	j := res.Jobs[0]
	if j.Error != 0 {
		return 0, 0, fmt.Errorf("fio's job failed with error %d", j.Error)
	}
	iops, ios := j.Read.IOPS+j.Write.IOPS, j.Read.TotalIOs+j.Write.TotalIOs
	if !(iops > 0) || !(ios > 0) {
		return 0, 0, fmt.Errorf("fio did no I/O (iops %v, ios %v)", iops, ios)
	}
	return iops, ios, nil
}

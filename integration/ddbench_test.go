package integration

import (
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/sector"
)

// Scenario 8 (issue 6): integration/ddbench, the GEOM ELI dd benchmark, runs on a small
// size and prints a complete table: a row per mode, a positive bytes/sec per sector size.
// Not parallel: it takes loop devices, and its figures mean little under other load.
func TestDDBench(t *testing.T) {
	needBlockTools(t)
	e := newEnv(t, true)
	out, err := commandErr(5*time.Minute, "./ddbench", "-s", "8", "-e", eliBin, "-d", e.Dir)
	if err != nil {
		t.Fatalf("ddbench: %v\n%s", err, out)
	}
	t.Logf("ddbench -s 8:\n%s", out)

	lines := strings.Split(out, "\n")
	head := -1
	for i, l := range lines {
		if f := strings.Fields(l); len(f) > 0 && f[0] == "mode" {
			head = i
			break
		}
	}
	if head < 0 {
		t.Fatalf("no table header (a line starting with 'mode'):\n%s", out)
	}
	if got, want := strings.Fields(lines[head]), []string{"mode", "512", "bytes/sec", "4096", "bytes/sec"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("table header %q, want columns %q", lines[head], want)
	}
	rows := map[string][]string{}
	for _, l := range lines[head+1:] {
		if f := strings.Fields(l); len(f) > 0 {
			rows[f[0]] = f[1:]
		}
	}
	for _, m := range sector.Modes() {
		cells, ok := rows[m.String()]
		if !ok {
			t.Errorf("no row for %s", m)
			continue
		}
		if len(cells) != 2 {
			t.Errorf("%s: %d cells %q, want 2 (512 and 4096)", m, len(cells), cells)
			continue
		}
		for i, c := range cells {
			if v, err := strconv.ParseInt(c, 10, 64); err != nil || v <= 0 {
				t.Errorf("%s at %s bytes: %q is not a positive number of bytes/sec", m, []string{"512", "4096"}[i], c)
			}
		}
		delete(rows, m.String())
	}
	if len(rows) != 0 {
		t.Errorf("rows for unknown modes: %v", rows)
	}
	// The script's work directory is gone, and with it every loop device on it.
	if out, _ := exec.Command("losetup", "--list", "--noheadings", "--output", "BACK-FILE").Output(); strings.Contains(string(out), e.Dir) {
		t.Errorf("ddbench left loop devices behind:\n%s", out)
	}
}

// TestDDBenchUsage: -h prints usage and exits 0; bad flags exit 2 without running.
func TestDDBenchUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"-h"}, 0, "usage: ddbench"},
		{[]string{"-x"}, 2, "usage: ddbench"},
		{[]string{"-s", "lots"}, 2, "-s takes a number"},
		{[]string{"-S", "1000"}, 2, "not a power of two"},
		{[]string{"-n", "0"}, 2, "-n takes a positive number"},
		{[]string{"extra"}, 2, "unexpected argument"},
	} {
		out, err := exec.Command("./ddbench", tc.args...).CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != tc.code || !strings.Contains(string(out), tc.want) {
			t.Errorf("ddbench %s: exit %d, want %d with %q:\n%s", strings.Join(tc.args, " "), code, tc.code, tc.want, out)
		}
	}
}

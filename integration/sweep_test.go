package integration

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
)

// t.Cleanup undoes mounts, loop devices, FUSE mounts and servers when a test fails, but
// not when the whole run dies (a -timeout panic, SIGKILL). sweepStale, at the start of
// the next run, removes what a dead run left in its own directories, so that a wedged
// loop device or mount cannot break every run after it. It touches only paths under
// this package's prefix whose run (the pid in the name) is gone.

var stalePathRE = regexp.MustCompile(`/` + workPrefix + `(\d+)-`)

// staleRun reports whether path lies under a directory made by a run that has exited.
func staleRun(path string) bool {
	m := stalePathRE.FindStringSubmatch(path)
	if m == nil {
		return false
	}
	pid, err := strconv.Atoi(m[1])
	if err != nil || pid == os.Getpid() {
		return false
	}
	return syscall.Kill(pid, 0) == syscall.ESRCH
}

func sweepStale() {
	// Deepest mount points first: an ext4 mount sits on a loop device that sits on a
	// file inside a FUSE mount (nbdfuse).
	var mounts, fuse []string
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			// mountinfo(5): ID parent major:minor root mountpoint options ... - fstype ...
			before, after, ok := strings.Cut(line, " - ")
			fields := strings.Fields(before)
			if !ok || len(fields) < 5 || !staleRun(fields[4]) {
				continue
			}
			if strings.HasPrefix(after, "fuse") {
				fuse = append(fuse, fields[4])
			} else {
				mounts = append(mounts, fields[4])
			}
		}
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		exec.Command("umount", "-l", mounts[i]).Run()
	}
	if out, err := exec.Command("losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			if f := strings.Fields(line); len(f) == 2 && staleRun(f[1]) {
				exec.Command("losetup", "-d", f[0]).Run()
			}
		}
	}
	for i := len(fuse) - 1; i >= 0; i-- {
		exec.Command("fusermount3", "-u", "-z", fuse[i]).Run()
	}
	for _, root := range []string{os.TempDir(), "/dev/shm"} {
		dirs, _ := filepath.Glob(filepath.Join(root, workPrefix+"*"))
		for _, d := range dirs {
			if !staleRun(d + "/") {
				continue
			}
			killStaleServers(d)
			os.RemoveAll(d)
		}
	}
}

// killStaleServers kills the eli servers whose state records lie in dir (a dead run's
// state directory), after checking that each pid is still an eli server.
func killStaleServers(dir string) {
	recs, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	for _, r := range recs {
		b, err := os.ReadFile(r)
		if err != nil {
			continue
		}
		var rec struct {
			Pid int `json:"pid"`
		}
		if json.Unmarshal(b, &rec) != nil || rec.Pid <= 1 {
			continue
		}
		cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(rec.Pid) + "/cmdline")
		if err != nil || !strings.Contains(string(cmdline), "__serve") {
			continue
		}
		syscall.Kill(rec.Pid, syscall.SIGKILL)
	}
}

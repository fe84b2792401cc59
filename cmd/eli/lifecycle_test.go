package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/volume"
)

// TestFailedAttachFreesName: an attach that fails in the background server returns only
// once the server has let go of the name and the provider, so that the very next attach
// (or this check) finds both free. Repeated, because the wrong order loses a race.
func TestFailedAttachFreesName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("f.img", "16M")
	sd := daemon.StateDir{Path: e.State}
	for i := 0; i < 5; i++ {
		e.FailsCode(1, "listen", "attach", "--passphrase-file", e.Pass, "--socket", "/proc/eli-cannot-be-here.sock", img)
		l, err := sd.LockName("f.img")
		if err != nil {
			t.Fatalf("attempt %d: the name is not free when the failed attach returns: %v", i, err)
		}
		p, err := provider.Open(img, false)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Lock(); err != nil {
			t.Fatalf("attempt %d: the provider is not free when the failed attach returns: %v", i, err)
		}
		p.Close()
		l.Release()
	}
	if ents, _ := os.ReadDir(e.State); len(ents) != 1 || ents[0].Name() != "f.img.log" {
		t.Errorf("state directory after failed attaches: %v; want only the failed server's log", ents)
	}
	e.attach(img)
	e.OK("detach", "f.img")
}

// TestStatusAndCleanDetach: eli status counts what the server served (text and JSON),
// list shows the state, and a clean detach leaves nothing in the state directory.
func TestStatusAndCleanDetach(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("st.img", "16M")
	sock := e.attach(img)
	c := dial(t, sock)
	if err := c.WriteAt(make([]byte, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := c.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	c.Close()
	var st volume.Status
	deadline := time.Now().Add(time.Minute) // hang guard: the status lags by up to 250 ms
	for st.Reads < 1 || st.Writes < 1 || st.Flushes < 1 || st.Commits < 1 {
		if time.Now().After(deadline) {
			t.Fatalf("status never counted the requests: %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
		if err := json.Unmarshal([]byte(e.OK("status", "--json", "st.img").Stdout), &st); err != nil {
			t.Fatal(err)
		}
	}
	if st.State != "serving" || st.Name != "st.img" || st.BytesWritten != 8192 || st.Journal != "zero" {
		t.Errorf("status --json: %+v", st)
	}
	// The background server answers its control socket.
	var live volume.Status
	sd := daemon.StateDir{Path: e.State}
	if err := control.Call(context.Background(), sd.ControlSocket("st.img"), daemon.OpStatus, nil, nil, &live); err != nil ||
		live.Pid != st.Pid || live.State != "serving" || live.Writes != st.Writes || live.Reads != st.Reads {
		t.Errorf("status through the control socket: %+v, %v; the status file says %+v", live, err, st)
	}
	out := e.OK("status", img).Stdout // by provider path
	for _, want := range []string{"state:", "serving", "reads:", "writes:", "flushes:", "auth failures:", "commits:", "journal at attach:", "last error:"} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	if list := e.OK("list").Stdout; !strings.Contains(list, "STATE") || !strings.Contains(list, "serving") {
		t.Errorf("list does not show the state:\n%s", list)
	}
	e.FailsCode(1, "is not attached", "status", "nosuch")

	e.OK("detach", "st.img")
	if ents, _ := os.ReadDir(e.State); len(ents) != 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("state directory after a clean detach: %v", names)
	}
	if _, err := os.Stat(e.State + "/st.img.status"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("status file after detach: %v", err)
	}
	e.FailsCode(1, "is not attached", "status", "st.img")
}

// TestDetachOfStartingServer: while the background server starts, until it has written
// its pid into the name's lock, the lock names the attach that started it, and 'eli
// detach' signals that process. Killed so, the attach must not leave its server behind,
// serving a volume that nobody was told of and holding the name against the detach that
// asked for it ('detach --force' then said the server survived SIGKILL). The test stops
// the server in that moment, once attach has handed it its setup, kills the attach as
// detach does, and lets the server go on.
func TestDetachOfStartingServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("s.img", "16M")
	sd := daemon.StateDir{Path: e.State}
	for attempt := 1; ; attempt++ {
		if attempt > 50 {
			t.Fatal("never caught the server before it took its name's lock over")
		}
		cmd := e.Command("attach", "--passphrase-file", e.Pass, img)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		parent := cmd.Process.Pid
		child, caught := catchStartingServer(t, sd, "s.img", parent)
		if !caught {
			// Too late: the server holds the name by its own pid. Start again.
			if child != 0 {
				syscall.Kill(child, syscall.SIGCONT)
			}
			cmd.Wait()
			e.OK("detach", "--force", "s.img")
			continue
		}
		syscall.Kill(parent, syscall.SIGTERM) // what detach sends the pid in the lock
		// The stop goes on to the server, stopped: it waits there, pending, until the
		// server goes on; the attach ends when the server has.
		waitPending(t, child, syscall.SIGTERM)
		syscall.Kill(child, syscall.SIGCONT)
		cmd.Wait()
		deadline := time.Now().Add(time.Minute) // a hang guard
		for daemon.ProcessRuns(child) || sd.Alive("s.img") {
			if _, err := sd.ReadRecord("s.img"); err == nil {
				e.OK("detach", "--force", "s.img")
				t.Fatalf("attempt %d: the server (pid %d) of an attach killed while it started serves on", attempt, child)
			}
			if time.Now().After(deadline) {
				t.Fatalf("attempt %d: the server (pid %d) of an attach killed while it started still runs", attempt, child)
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Logf("caught the server at attempt %d", attempt)
		break
	}
	if out := e.OK("list").Stdout; strings.Contains(out, "s.img") {
		t.Errorf("list after the attach was killed:\n%s", out)
	}
	e.attach(img)
	e.OK("detach", "s.img")
}

// catchStartingServer waits for the background server that attach process parent
// starts and stops it (SIGSTOP) at once; caught reports whether that was while the
// name's lock still named parent, after parent had written the server's setup and
// closed its end of the pipe.
func catchStartingServer(t *testing.T, sd daemon.StateDir, name string, parent int) (child int, caught bool) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); child == 0; {
		if time.Now().After(deadline) {
			t.Fatal("attach started no server")
		}
		if exited(parent) {
			return 0, false // the whole attach was done before the server was seen
		}
		child = childOf(parent)
	}
	syscall.Kill(child, syscall.SIGSTOP)
	for deadline := time.Now().Add(time.Minute); procState(child) != "T"; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) || exited(child) {
			t.Fatalf("the server (pid %d) did not stop", child)
		}
	}
	if b, _ := os.ReadFile(sd.File(name, ".lock")); strings.TrimSpace(string(b)) != strconv.Itoa(parent) {
		return child, false
	}
	// The setup pipe is the server's descriptor 5 (fdSetup); attach closes its end once
	// it has written the setup.
	setup, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", child, fdSetup))
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("attach never wrote the server's setup")
		}
		held := false
		fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", parent))
		for _, fd := range fds {
			if l, _ := os.Readlink(fd); l == setup {
				held = true
			}
		}
		if !held {
			return child, true
		}
	}
}

// exited reports whether process pid (not waited for yet) has ended.
func exited(pid int) bool { return !daemon.ProcessRuns(pid) }

// procState is process pid's state letter (/proc/PID/stat), or "" if there is none.
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	i := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[i+1:]))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// waitPending waits until sig is pending for process pid (/proc/PID/status, ShdPnd).
func waitPending(t *testing.T, pid int, sig syscall.Signal) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%v never came to process %d", sig, pid)
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "ShdPnd:"); ok {
				if m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err == nil && m&(1<<(uint(sig)-1)) != 0 {
					return
				}
			}
		}
	}
}

// childOf is a process whose parent is pid and that runs eli's background server, or 0.
func childOf(pid int) int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		stat, err := os.ReadFile(d + "/stat")
		if err != nil {
			continue
		}
		i := strings.LastIndexByte(string(stat), ')')
		f := strings.Fields(string(stat[i+1:]))
		if len(f) < 2 || f[1] != strconv.Itoa(pid) {
			continue
		}
		if args, _ := os.ReadFile(d + "/cmdline"); strings.Contains(string(args), "__serve") {
			n, _ := strconv.Atoi(filepath.Base(d))
			return n
		}
	}
	return 0
}

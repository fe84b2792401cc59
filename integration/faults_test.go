package integration

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/faultproxy"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/nbdclient"
)

// Issue 38: what eli does around faults. Each test here failed on the code before the
// issue (run with ELI_BIN=an older eli to see it).

// proxiedStorage serves a new file of size bytes with nbdkit and puts a fault proxy in
// front of it; eli is given the proxy's URI.
func proxiedStorage(e *env, size int64) (*storage, *faultproxy.Proxy, string) {
	st := newStorage(e, "nbdkit", size, nil, nil)
	p := faultproxy.New("unix", st.sock, e.t.Logf)
	sock := filepath.Join(e.mkdirTemp("", "fp"), "p")
	if err := p.Listen("unix", sock); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(p.Close)
	return st, p, "nbd+unix:///?socket=" + sock
}

// alive reports whether pid is a server of e that runs: it exists, is not a zombie (a
// server whose parent exited is reaped by init, which may take a moment), and is eli's
// server for e's state directory, not a process that took the pid over since (pids wrap
// quickly on a busy test machine).
func alive(e *env, pid int) bool {
	if pid <= 0 || syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) && (b[i+2] == 'Z' || b[i+2] == 'X') {
		// A killed process's first thread is a zombie before its other threads have
		// ended, and its descriptors (its locks) go with the last of them: it counts as
		// alive until then (a re-attach right after kill -9 found the volume held).
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		return len(tasks) > 1
	}
	args, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	env, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	return bytes.Contains(args, []byte("\x00__serve")) && bytes.Contains(env, []byte("ELI_STATE_DIR="+e.State+"\x00"))
}

// exited reports whether process pid has exited: it is a zombie or gone.
func exited(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	i := bytes.LastIndexByte(b, ')')
	return err != nil || (i > 0 && i+2 < len(b) && (b[i+2] == 'Z' || b[i+2] == 'X'))
}

// stopped reports whether process pid is stopped (state T in /proc/PID/stat).
func stopped(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	i := bytes.LastIndexByte(b, ')')
	return err == nil && i > 0 && i+2 < len(b) && b[i+2] == 'T'
}

// listed is `eli list --json`, with the states.
func listed(e *env) []struct {
	Name  string `json:"name"`
	Pid   int    `json:"pid"`
	State string `json:"state"`
} {
	e.t.Helper()
	r := e.Run("", "list", "--json")
	var out []struct {
		Name  string `json:"name"`
		Pid   int    `json:"pid"`
		State string `json:"state"`
	}
	if r.Code != 0 || json.Unmarshal([]byte(r.Stdout), &out) != nil {
		e.t.Fatalf("eli list --json: %v", r)
	}
	return out
}

// timed runs eli and says how long it took.
func timed(e *env, args ...string) (elitest.Result, time.Duration) {
	e.t.Helper()
	start := time.Now()
	r := e.Run("", args...)
	return r, time.Since(start)
}

// TestDetachStorageGone: the remote storage dies for good under an attached volume.
// detach ends the server within its --timeout (it used to leave a server that
// outlived detach, hid it from list and kept its name), says that the final commit did
// not reach the storage and what state the data is in, and exits 1; nothing of the
// server is left, the name is free, and once the storage is back the volume attaches
// with everything flushed before.
func TestDetachStorageGone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	_, p, uri := proxiedStorage(e, 32<<20)
	e.remoteInit(uri)
	sock := e.Attach(uri, "--name", "z") // the default timeouts: detach bounds them itself
	pid := e.Attached("z").Pid
	flushed := bytes.Repeat([]byte("flushed before the storage died "), 128)
	c := dialWithData(t, sock, flushed)
	if err := c.WriteAt(bytes.Repeat([]byte{7}, 4096), 1<<20, false); err != nil { // acknowledged, never flushed
		t.Fatal(err)
	}
	c.Close()
	p.Kill()

	const timeout = 20 * time.Second
	r, took := timed(e, "detach", "--timeout", timeout.String(), "z")
	if took > timeout+5*time.Second {
		t.Fatalf("detach took %v with --timeout %v", took, timeout)
	}
	if r.Code != 1 || !strings.Contains(r.Stderr, "final commit") || !strings.Contains(r.Stderr, "flushed before the failure is safe") {
		t.Fatalf("detach with the storage gone: want exit 1 saying the final commit failed and what is safe: %v\nserver log:\n%s", r, e.serverLog("z"))
	}
	if alive(e, pid) {
		t.Fatalf("the server (pid %d) outlived detach; list says %+v", pid, listed(e))
	}
	if l := listed(e); len(l) != 0 {
		t.Fatalf("list after detach: %+v", l)
	}
	if err := p.Restart(); err != nil {
		t.Fatal(err)
	}
	sock = e.Attach(uri, "--name", "z")
	c = dialURI(t, sock)
	got := make([]byte, len(flushed))
	if err := c.ReadAt(got, 8192); err != nil || !bytes.Equal(got, flushed) {
		t.Fatalf("what was flushed before the storage died: %v", err)
	}
	c.Close()
	e.detach("z")
}

// TestFrozenServer: a server that is stopped (SIGSTOP) is listed as frozen, detach
// says so instead of waiting for it, and detach --force ends it and frees the name.
// ('suspended' is eli suspend's state: suspend_test.go.)
func TestFrozenServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false)
	img := e.create(volume{name: "s.img", size: "16M"})
	e.Attach(img)
	pid := e.Attached("s.img").Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// No cleanup of its own by pid, which another process may have by then: the
	// env's DetachAll kills a frozen server with detach --force.
	for deadline := time.Now().Add(time.Minute); !stopped(pid) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond) // the signal is delivered asynchronously
	}
	if l := listed(e); len(l) != 1 || l[0].State != "frozen" || l[0].Pid != pid {
		t.Fatalf("list of a stopped server: %+v, want it frozen", l)
	}
	if r := e.Run("", "status", "s.img"); r.Code != 1 || !strings.Contains(r.Stderr, "frozen") {
		t.Fatalf("status of a stopped server: %v", r)
	}
	r, took := timed(e, "detach", "--timeout", "30s", "s.img")
	if r.Code != 1 || !strings.Contains(r.Stderr, "frozen") || took > 20*time.Second {
		t.Fatalf("detach of a stopped server: want it refused at once, naming the state (took %v): %v", took, r)
	}
	r, took = timed(e, "detach", "--force", "--timeout", "30s", "s.img")
	if took > 20*time.Second || alive(e, pid) {
		t.Fatalf("detach --force of a stopped server took %v; alive %v: %v", took, alive(e, pid), r)
	}
	if !strings.Contains(r.Stderr, "killed") {
		t.Errorf("detach --force after killing does not say so: %v", r)
	}
	e.Attach(img) // the name and the volume are free
	e.detach("s.img")
}

// TestWitnessLoud: a volume that cannot keep its witness says so at attach, in status
// and list (degraded), and in detach's exit status; a written volume without a witness
// on this host is attached with a warning that says what that means.
func TestWitnessLoud(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false)
	img := e.create(volume{name: "w.img", size: "16M"})
	bad := "/proc/nonexistent/witness"
	r := e.OK("attach", "--passphrase-file", e.Pass, "--witness", bad, img)
	if !strings.Contains(r.Stderr, "warning") || !strings.Contains(r.Stderr, bad) || !strings.Contains(r.Stderr, "rollback") {
		t.Fatalf("attach with a witness that cannot be written says nothing of it: %v", r)
	}
	sock := elitest.SocketOf(strings.TrimSpace(r.Stdout))
	c := dialWithData(t, "nbd+unix:///?socket="+sock, bytes.Repeat([]byte{1}, 4096))
	c.Close()
	if l := listed(e); len(l) != 1 || l[0].State != "degraded" {
		t.Fatalf("list: %+v, want the volume degraded", l)
	}
	if s := e.Run("", "status", "w.img"); s.Code != 1 || !strings.Contains(s.Stdout, "degraded") || !strings.Contains(s.Stderr, bad) {
		t.Fatalf("status of a volume without its witness: %v", s)
	}
	if d := e.Run("", "detach", "w.img"); d.Code != 1 || !strings.Contains(d.Stderr, "witness") || !strings.Contains(d.Stderr, "data is safe") {
		t.Fatalf("detach of a volume whose witness was never written: %v", d)
	}

	// Written with a witness, which is then lost: the next attach says so.
	uri := e.Attach(img)
	c = dialWithData(t, uri, bytes.Repeat([]byte{2}, 4096))
	c.Close()
	e.detach("w.img")
	w, err := filepath.Glob(filepath.Join(e.Witness, "*"))
	if err != nil || len(w) != 1 {
		t.Fatalf("witness files %v %v", w, err)
	}
	if err := os.Remove(w[0]); err != nil {
		t.Fatal(err)
	}
	r = e.OK("attach", "--passphrase-file", e.Pass, img)
	if !strings.Contains(r.Stderr, "no witness") || !strings.Contains(r.Stderr, "generation") {
		t.Fatalf("attach of a written volume without its witness says nothing of it: %v", r)
	}
	e.detach("w.img")
}

// loopDevice sets up a loop device over img and returns its path.
func loopDevice(t *testing.T, img string) string {
	t.Helper()
	testtool.NeedRoot(t)
	testtool.Need(t, "losetup", "mount")
	out, err := commandErr(time.Minute, "losetup", "--find", "--show", img)
	if err != nil {
		t.Fatalf("losetup: %v\n%s", err, out)
	}
	loop := strings.TrimSpace(out)
	t.Cleanup(func() {
		if out, err := commandErr(time.Minute, "losetup", "-d", loop); err != nil {
			t.Errorf("losetup -d %s: %v\n%s", loop, err, out)
		}
	})
	return loop
}

// TestReadOnlyBesideWriter: a read-only attach through another path while the volume
// is attached read-write is refused (it would serve what the writer's commits leave
// behind it), and so is a writer beside a read-only attach; read-only attaches run
// together.
func TestReadOnlyBesideWriter(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false)
	img := e.create(volume{name: "f.img", size: "16M"})
	loop := loopDevice(t, img)
	e.Attach(img)
	e.Fails("open for writing", "attach", "--passphrase-file", e.Pass, "--readonly", "--name", "ro", loop)
	e.detach("f.img")

	e.Attach(loop, "--readonly", "--name", "ro")
	e.Fails("read-only", "attach", "--passphrase-file", e.Pass, img)
	e.Attach(img, "--readonly", "--name", "ro2") // another reader: fine
	e.detach("ro")
	e.detach("ro2")
	e.Attach(img)
	e.detach("f.img")
}

// slowKDF makes volume keyslots take seconds to open, so that an attach is still in its
// key derivation when a second one starts.
var slowKDF = []string{"--kdf-time", "300", "--kdf-memory", "8", "--kdf-threads", "1"}

// startAttach runs an attach in the background and returns its result when waited.
func startAttach(e *env, args ...string) func() elitest.Result {
	cmd := e.Command(append([]string{"attach"}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	return func() elitest.Result {
		err := cmd.Wait()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		}
		return elitest.Result{Code: code, Stdout: out.String(), Stderr: errb.String()}
	}
}

// TestFairLockContention: an attach holds no lock while it derives keys or checks the
// witness, so one that will fail (a wrong passphrase, a stale copy of the volume)
// never keeps one that would succeed from the volume or its name, and what the loser
// is told is true.
func TestFairLockContention(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false)
	wrong := e.Write("wrong", "not the passphrase\n")
	img := e.Path("v.img")
	e.OK(append(append([]string{"init", "--size", "16M", "--passphrase-file", e.Pass}, slowKDF...), img)...)
	link := e.Path("v-link.img")
	if err := os.Link(img, link); err != nil {
		t.Fatal(err)
	}
	race := func(what string, loser, winner []string) (lost, won elitest.Result) {
		t.Helper()
		wait := startAttach(e, loser...)
		time.Sleep(500 * time.Millisecond) // the loser is in its key derivation now
		won = e.Run("", append([]string{"attach"}, winner...)...)
		lost = wait()
		if won.Code != 0 {
			t.Fatalf("%s: the attach with valid keys failed: %v\n(the other: %v)", what, won, lost)
		}
		return lost, won
	}

	// A wrong passphrase through one path, the right one through a hard link.
	lost, _ := race("wrong passphrase", []string{"--passphrase-file", wrong, "--name", "a", link}, []string{"--passphrase-file", e.Pass, "--name", "b", img})
	if lost.Code == 0 {
		t.Fatalf("the wrong passphrase attached: %v", lost)
	}
	e.detach("b")

	// The same name for two volumes: the one with a wrong passphrase does not hold it.
	other := e.Path("o.img")
	e.OK(append(append([]string{"init", "--size", "16M", "--passphrase-file", e.Pass}, slowKDF...), other)...)
	race("one name", []string{"--passphrase-file", wrong, "--name", "n", img}, []string{"--passphrase-file", e.Pass, "--name", "n", other})
	e.detach("n")

	// A stale copy of the volume (same ID, older generation) racing the original.
	stale := e.Path("stale.img")
	raw, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(stale, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	uri := e.Attach(img, "--name", "orig")
	c := dialWithData(t, uri, bytes.Repeat([]byte{3}, 4096))
	c.Close()
	e.detach("orig")
	lost, _ = race("stale copy", []string{"--passphrase-file", e.Pass, "--name", "copy", stale}, []string{"--passphrase-file", e.Pass, "--name", "orig", img})
	if lost.Code == 0 || !strings.Contains(lost.Stderr, "older") {
		t.Fatalf("the stale copy: want it refused as older than its witness: %v", lost)
	}

	// Both valid (the original through two paths): the loser names the live server.
	r := e.Run("", "attach", "--passphrase-file", e.Pass, "--name", "again", link)
	pid := e.Attached("orig").Pid
	if r.Code == 0 || !strings.Contains(r.Stderr, fmt.Sprintf("pid %d", pid)) || !alive(e, pid) {
		t.Fatalf("attach of a served volume through another path: want it refused naming the server (pid %d): %v", pid, r)
	}
	if strings.Contains(r.Stderr, "choose another") {
		t.Fatalf("the refusal suggests another name, which would not help: %v", r)
	}
	e.detach("orig")
}

// TestInitRefusesForeignData: init names what a provider holds (here ext4) and refuses
// to destroy it without --force; a mounted device gets one line saying so.
func TestInitRefusesForeignData(t *testing.T) {
	t.Parallel()
	mkfs := testtool.Need(t, "mkfs.ext4", "e2fsprogs")
	e := newEnv(t, false)
	img := e.Path("e.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	command(t, time.Minute, mkfs, "-q", "-F", img)
	before := elitest.FileHash(t, img)
	initArgs := append([]string{"init", "--passphrase-file", e.Pass}, elitest.QuickKDF...)
	e.FailsCode(1, "ext4 filesystem", append(initArgs, img)...)
	if elitest.FileHash(t, img) != before {
		t.Fatal("a refused init changed the provider")
	}

	// Mounted: one clear line whatever the flags.
	loop := loopDevice(t, img)
	mnt := e.mkdirTemp("", "mnt")
	command(t, time.Minute, "mount", loop, mnt)
	t.Cleanup(func() { commandErr(time.Minute, "umount", mnt) })
	r := e.FailsCode(1, "mounted on "+mnt, append(initArgs, "--force", loop)...)
	if strings.Contains(r.Stderr, "busy") && !strings.Contains(r.Stderr, "in use") {
		t.Errorf("the refusal of a mounted device: %v", r)
	}
	command(t, time.Minute, "umount", mnt)

	e.OK(append(initArgs, "--force", img)...)
}

// TestMessagesThatHelp: status exits 1 for a killed server; attach warns when header
// copy B is missing; dump shows what a truncated provider's header says; an NBD socket
// that does not exist is named as such, not taken for a file to create.
func TestMessagesThatHelp(t *testing.T) {
	t.Parallel()
	t.Run("killed server", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, false)
		img := e.create(volume{name: "m.img", size: "16M"})
		e.Attach(img)
		pid := e.Attached("m.img").Pid
		syscall.Kill(pid, syscall.SIGKILL)
		// Gone means a zombie or no process: a dying process tears its memory down
		// (and its /proc entries with it) before it closes its files, and its locks.
		for deadline := time.Now().Add(time.Minute); !exited(pid) && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
		if r := e.Run("", "status", "m.img"); r.Code != 1 || !strings.Contains(r.Stderr, "killed") {
			t.Fatalf("status of a killed server: want exit 1 saying so: %v", r)
		}
	})
	t.Run("copy B missing", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, false)
		img := e.create(volume{name: "m.img", size: "16M"})
		f, err := os.OpenFile(img, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		fi, _ := f.Stat()
		if _, err := f.WriteAt(make([]byte, 64<<10), fi.Size()-64<<10); err != nil { // copy B's place
			t.Fatal(err)
		}
		f.Close()
		r := e.OK("attach", "--passphrase-file", e.Pass, img)
		if !strings.Contains(r.Stderr, "warning") || !strings.Contains(r.Stderr, "no eli header at offset") {
			t.Fatalf("attach with header copy B missing says nothing: %v", r)
		}
		e.detach("m.img")
	})
	t.Run("truncated", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, false)
		img := e.create(volume{name: "m.img", size: "16M"})
		if err := os.Truncate(img, 8<<20); err != nil {
			t.Fatal(err)
		}
		r := e.Run("", "dump", img)
		if r.Code != 0 || !strings.Contains(r.Stdout, "volume id") || !strings.Contains(r.Stderr, "truncated") {
			t.Fatalf("dump of a truncated provider: %v", r)
		}
	})
	t.Run("missing socket", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, false)
		r := e.Fails("no such", append(append([]string{"init", "--size", "64M", "--passphrase-file", e.Pass}, elitest.QuickKDF...),
			"nbd+unix:///?socket=/nonexistent/eli-test")...)
		if strings.Contains(r.Stderr, "give --size") {
			t.Fatalf("init of a missing NBD socket asks for --size: %v", r)
		}
	})
}

// TestRemoteTimeoutFlags: --io-timeout and --queue-timeout reach the server: a volume
// whose storage stalls longer than --io-timeout but shorter than --queue-timeout
// serves on with nothing failed, and one with --queue-timeout 0 fails the request.
func TestRemoteTimeoutFlags(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	_, p, uri := proxiedStorage(e, 32<<20)
	e.remoteInit(uri)
	sock := e.Attach(uri, "--name", "q", "--io-timeout", "500ms", "--queue-timeout", "1m")
	c := dialWithData(t, sock, bytes.Repeat([]byte{5}, 4096))
	defer c.Close()
	p.Stall()
	done := make(chan error, 1)
	go func() {
		if err := c.WriteAt(bytes.Repeat([]byte{6}, 4096), 65536, false); err != nil {
			done <- err
			return
		}
		done <- c.Flush()
	}()
	time.Sleep(3 * time.Second) // six times --io-timeout
	if st := e.Run("", "status", "q").Stdout; !strings.Contains(st, "storage") {
		t.Errorf("status while the storage stalls does not name it:\n%s", st)
	}
	p.Resume()
	if err := <-done; err != nil {
		t.Fatalf("a flush held across a stall shorter than --queue-timeout: %v\n%s", err, e.serverLog("q"))
	}
	c.Close()
	e.detach("q")

	sock = e.Attach(uri, "--name", "q", "--io-timeout", "500ms", "--queue-timeout", "0")
	c = dialURI(t, sock)
	p.Stall()
	start := time.Now()
	err := c.ReadAt(make([]byte, 4096), 16<<20) // not cached: goes to the storage
	p.Resume()
	if err == nil || time.Since(start) > 30*time.Second {
		t.Fatalf("a read with --queue-timeout 0 over a stalled storage: %v after %v, want an error soon after --io-timeout", err, time.Since(start))
	}
	c.Close()
	e.detach("q")
	if e.Run("", "attach", "--queue-timeout", "soon", uri).Code != 2 {
		t.Error("a bad --queue-timeout is not a usage error")
	}
}

// dialURI connects to the export at an nbd+unix URI.
func dialURI(t *testing.T, uri string) *nbdclient.Client {
	t.Helper()
	c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	return c
}

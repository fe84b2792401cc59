package integration

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/sector"
)

// env is one test's world: a directory for providers (tmpfs when asked), a short state
// directory (unix socket paths are limited to 108 bytes, and t.TempDir paths of subtests
// come close), and a passphrase file.
type env struct {
	t     testing.TB
	dir   string
	state string
	pass  string
}

// newEnv makes a world for t. With tmpfs, providers live in /dev/shm, where copying
// hundreds of MiB costs memory bandwidth instead of disk writes on a shared CI machine.
func newEnv(t testing.TB, tmpfs bool) *env {
	t.Helper()
	e := &env{t: t}
	if st, err := os.Stat("/dev/shm"); tmpfs && err == nil && st.IsDir() {
		e.dir = e.mkdirTemp("/dev/shm", "p")
	} else {
		e.dir = t.TempDir()
	}
	e.state = e.mkdirTemp("", "st")
	if err := os.Chmod(e.state, 0o700); err != nil {
		t.Fatal(err)
	}
	e.pass = e.write("pass", "correct horse battery staple\n")
	t.Cleanup(e.detachAll) // runs before the directories are removed
	return e
}

// mkdirTemp makes a directory under root named with this run's prefix and pid (see
// sweepStale), removed when the test ends.
func (e *env) mkdirTemp(root, what string) string {
	e.t.Helper()
	d, err := os.MkdirTemp(root, fmt.Sprintf("%s%d-%s", workPrefix, os.Getpid(), what))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func (e *env) path(name string) string { return filepath.Join(e.dir, name) }

func (e *env) write(name, content string) string {
	e.t.Helper()
	p := e.path(name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		e.t.Fatal(err)
	}
	return p
}

type result struct {
	code           int
	stdout, stderr string
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
}

// run runs eli with args in the env's state directory; stdin is its standard input.
func (e *env) run(stdin string, args ...string) result {
	e.t.Helper()
	cmd := exec.Command(eliBin, args...)
	cmd.Dir = e.dir
	cmd.Env = append(os.Environ(), "ELI_STATE_DIR="+e.state)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		e.t.Fatal(err)
	}
	return result{code, out.String(), errb.String()}
}

// ok runs eli and fails the test unless it exits 0.
func (e *env) ok(args ...string) result {
	e.t.Helper()
	r := e.run("", args...)
	if r.code != 0 {
		e.t.Fatalf("eli %s: %v", strings.Join(args, " "), r)
	}
	return r
}

// fails runs eli and checks that it exits non-zero with exactly one line on stderr that
// contains want.
func (e *env) fails(want string, args ...string) result {
	e.t.Helper()
	r := e.run("", args...)
	if r.code == 0 {
		e.t.Fatalf("eli %s succeeded, want a failure: %v", strings.Join(args, " "), r)
	}
	if !strings.Contains(r.stderr, want) {
		e.t.Fatalf("eli %s: stderr lacks %q: %v", strings.Join(args, " "), want, r)
	}
	if lines := strings.Count(strings.TrimSpace(r.stderr), "\n") + 1; lines != 1 {
		e.t.Fatalf("eli %s: want one line on stderr, got %d: %v", strings.Join(args, " "), lines, r)
	}
	return r
}

// quickKDF keeps Argon2id cheap; real volumes calibrate to about a second.
var quickKDF = []string{"--kdf-time", "1", "--kdf-memory", "8", "--kdf-threads", "1"}

// volume is how a test asks for a new eli volume.
type volume struct {
	name   string // file name of the provider in the env's directory
	size   string // provider size for --size
	mode   string // --cipher; "" for the default
	sector int    // --sector-size; 0 for the default
	extra  []string
}

// initArgs is the eli init command line for v (without the provider).
func (e *env) initArgs(v volume) []string {
	args := append([]string{"init", "--size", v.size, "--passphrase-file", e.pass}, quickKDF...)
	if v.mode != "" {
		args = append(args, "--cipher", v.mode)
		if isUnsafeMode(v.mode) {
			args = append(args, "--unsafe")
		}
	}
	if v.sector != 0 {
		args = append(args, "--sector-size", strconv.Itoa(v.sector))
	}
	return append(args, v.extra...)
}

// create runs eli init for v and returns the provider's path.
func (e *env) create(v volume) string {
	e.t.Helper()
	p := e.path(v.name)
	e.ok(append(e.initArgs(v), p)...)
	return p
}

// isUnsafeMode reports whether init needs --unsafe for mode.
func isUnsafeMode(mode string) bool {
	m, err := sector.ParseMode(mode)
	return err == nil && m.Unsafe()
}

// attach attaches provider and returns the NBD URI, the last line attach prints.
func (e *env) attach(provider string, extra ...string) string {
	e.t.Helper()
	r := e.ok(append(append([]string{"attach", "--passphrase-file", e.pass}, extra...), provider)...)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	uri := lines[len(lines)-1]
	if !strings.HasPrefix(uri, "nbd+unix:///?socket=") {
		e.t.Fatalf("last line of attach is not an NBD unix URI: %q", r.stdout)
	}
	return uri
}

// socketOf is the unix socket of an nbd+unix URI.
func socketOf(uri string) string { return strings.TrimPrefix(uri, "nbd+unix:///?socket=") }

func (e *env) detach(name string) {
	e.t.Helper()
	e.ok("detach", name)
}

// detachAll stops every server of this env, even a wedged one: a failing test must not
// leave servers behind.
func (e *env) detachAll() {
	for _, r := range e.list() {
		e.run("", "detach", "--force", "--timeout", "20s", r.Name)
	}
}

// record is what `eli list --json` says about an attached volume (the fields tests use).
type record struct {
	Name       string `json:"name"`
	Provider   string `json:"provider"`
	Mode       string `json:"mode"`
	SectorSize int    `json:"sector_size"`
	Size       int64  `json:"size"`
	Socket     string `json:"socket"`
	URI        string `json:"uri"`
	Pid        int    `json:"pid"`
	Log        string `json:"log"`
}

func (e *env) list() []record {
	e.t.Helper()
	r := e.run("", "list", "--json")
	if r.code != 0 {
		e.t.Errorf("eli list --json: %v", r)
		return nil
	}
	var recs []record
	if err := json.Unmarshal([]byte(r.stdout), &recs); err != nil {
		e.t.Errorf("eli list --json: %v\n%s", err, r.stdout)
	}
	return recs
}

// attached returns the record of name, failing the test when it is not attached.
func (e *env) attached(name string) record {
	e.t.Helper()
	for _, r := range e.list() {
		if r.Name == name {
			return r
		}
	}
	e.t.Fatalf("%s is not attached", name)
	return record{}
}

// serverLog is the background server's log of name (for failure messages).
func (e *env) serverLog(name string) string {
	b, err := os.ReadFile(filepath.Join(e.state, name+".log"))
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return string(b)
}

// fileHash is the SHA-256 of a file's contents, to show that a command changed nothing.
func fileHash(t testing.TB, path string) [32]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return [32]byte(h.Sum(nil))
}

// command runs an external program and fails the test unless it exits 0 within limit.
func command(t testing.TB, limit time.Duration, name string, args ...string) string {
	t.Helper()
	out, err := commandErr(limit, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

// commandErr runs an external program, bounded in time, and returns its combined output.
func commandErr(limit time.Duration, name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return "", err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return out.String(), err
	case <-time.After(limit):
		cmd.Process.Kill()
		<-done
		return out.String(), fmt.Errorf("still running after %v: killed", limit)
	}
}

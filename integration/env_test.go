package integration

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/sector"
)

// env is one test's world: a directory for providers (tmpfs when asked), a short state
// directory (unix socket paths are limited to 108 bytes, and t.TempDir paths of subtests
// come close), and a passphrase file.
type env struct {
	*elitest.CLI
	t testing.TB
}

// newEnv makes a world for t. With tmpfs, providers live in /dev/shm, where copying
// hundreds of MiB costs memory bandwidth instead of disk writes on a shared CI machine.
func newEnv(t testing.TB, tmpfs bool) *env {
	t.Helper()
	e := &env{t: t}
	dir := t.TempDir()
	if st, err := os.Stat("/dev/shm"); tmpfs && err == nil && st.IsDir() {
		dir = e.mkdirTemp("/dev/shm", "p")
	}
	state := e.mkdirTemp("", "st")
	if err := os.Chmod(state, 0o700); err != nil {
		t.Fatal(err)
	}
	e.CLI = elitest.New(t, eliBin, dir, state) // detaches everything before the dirs go
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
	args := append([]string{"init", "--size", v.size, "--passphrase-file", e.Pass}, elitest.QuickKDF...)
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
	p := e.Path(v.name)
	e.OK(append(e.initArgs(v), p)...)
	return p
}

// isUnsafeMode reports whether init needs --unsafe for mode.
// isUnsafeMode reports whether init needs --unsafe for mode: the fixed-keystream modes
// and none.
func isUnsafeMode(mode string) bool {
	m, err := sector.ParseMode(mode)
	return err == nil && (m.Unsafe() || m == sector.ModeNone)
}

func (e *env) detach(name string) {
	e.t.Helper()
	e.OK("detach", name)
}

// serverLog is the background server's log of name (for failure messages).
func (e *env) serverLog(name string) string {
	b, err := os.ReadFile(filepath.Join(e.State, name+".log"))
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return string(b)
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

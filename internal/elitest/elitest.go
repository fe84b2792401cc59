// Package elitest drives the real eli binary the way users and scripts do, for the CLI
// tests in cmd/eli and the end-to-end tests in integration: build it once, run it with
// arguments and standard input in a state directory of the test's own, and check exit
// codes and the one line on stderr that explains a failure.
package elitest

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
	"strings"
	"testing"
)

// Build compiles the eli command in pkgDir (a path relative to the caller's package)
// into dir and returns the binary's path.
func Build(dir, pkgDir string) (string, error) {
	bin := filepath.Join(dir, "eli")
	if out, err := exec.Command("go", "build", "-o", bin, pkgDir).CombinedOutput(); err != nil {
		return "", fmt.Errorf("build eli: %v\n%s", err, out)
	}
	return bin, nil
}

// QuickKDF keeps Argon2id cheap in tests; real volumes calibrate to about a second.
var QuickKDF = []string{"--kdf-time", "1", "--kdf-memory", "8", "--kdf-threads", "1"}

// CLI runs one eli binary for one test: in Dir (where providers go), with State as the
// state directory, and Pass a passphrase file.
type CLI struct {
	T     testing.TB
	Bin   string
	Dir   string
	State string
	Pass  string
	// Witness is the directory of the witnesses of its volumes' freshness (format
	// version 2), apart from Dir so that what a running server writes there after a
	// flush is not taken for a change to the test's files.
	Witness string
}

// Passphrase is what Pass holds (without its newline).
const Passphrase = "correct horse battery staple"

// New writes the passphrase file and makes sure every volume the test attached is
// detached when it ends (registered now, so it runs before the directories go).
func New(t testing.TB, bin, dir, state string) *CLI {
	t.Helper()
	c := &CLI{T: t, Bin: bin, Dir: dir, State: state, Witness: filepath.Join(t.TempDir(), "witness")}
	c.Pass = c.Write("pass", Passphrase+"\n")
	t.Cleanup(c.DetachAll)
	return c
}

// Path is name inside Dir.
func (c *CLI) Path(name string) string { return filepath.Join(c.Dir, name) }

// Write creates a file of mode 0600 in Dir and returns its path.
func (c *CLI) Write(name, content string) string {
	c.T.Helper()
	p := c.Path(name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		c.T.Fatal(err)
	}
	return p
}

// Result is what one run of eli did.
type Result struct {
	Code           int
	Stdout, Stderr string
}

func (r Result) String() string {
	return fmt.Sprintf("exit %d\nstdout: %s\nstderr: %s", r.Code, r.Stdout, r.Stderr)
}

// Command is eli with args, set up to run in Dir with State as its state directory.
func (c *CLI) Command(args ...string) *exec.Cmd {
	cmd := exec.Command(c.Bin, args...)
	cmd.Dir = c.Dir
	cmd.Env = append(os.Environ(), "ELI_STATE_DIR="+c.State, "ELI_WITNESS_DIR="+c.Witness)
	return cmd
}

// Run runs eli with args; stdin is its standard input.
func (c *CLI) Run(stdin string, args ...string) Result {
	c.T.Helper()
	cmd := c.Command(args...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		c.T.Fatal(err)
	}
	return Result{code, out.String(), errb.String()}
}

// OK runs eli and fails the test unless it exits 0.
func (c *CLI) OK(args ...string) Result {
	c.T.Helper()
	r := c.Run("", args...)
	if r.Code != 0 {
		c.T.Fatalf("eli %s: %v", strings.Join(args, " "), r)
	}
	return r
}

// Fails runs eli and checks that it exits non-zero with exactly one line on stderr that
// contains want.
func (c *CLI) Fails(want string, args ...string) Result {
	c.T.Helper()
	return c.fails(-1, want, args)
}

// FailsCode is Fails with a given exit code.
func (c *CLI) FailsCode(code int, want string, args ...string) Result {
	c.T.Helper()
	return c.fails(code, want, args)
}

func (c *CLI) fails(code int, want string, args []string) Result {
	c.T.Helper()
	r := c.Run("", args...)
	cmdline := strings.Join(args, " ")
	switch {
	case r.Code == 0:
		c.T.Fatalf("eli %s succeeded, want a failure: %v", cmdline, r)
	case code >= 0 && r.Code != code:
		c.T.Fatalf("eli %s: want exit %d: %v", cmdline, code, r)
	case !strings.Contains(r.Stderr, want):
		c.T.Fatalf("eli %s: stderr lacks %q: %v", cmdline, want, r)
	}
	if lines := strings.Count(strings.TrimSpace(r.Stderr), "\n") + 1; lines != 1 {
		c.T.Fatalf("eli %s: want one line on stderr, got %d: %v", cmdline, lines, r)
	}
	return r
}

// Attach attaches provider with the passphrase file and returns the NBD URI, the last
// line attach prints.
func (c *CLI) Attach(provider string, extra ...string) string {
	c.T.Helper()
	r := c.OK(append(append([]string{"attach", "--passphrase-file", c.Pass}, extra...), provider)...)
	lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
	uri := lines[len(lines)-1]
	if !strings.HasPrefix(uri, URIPrefix) {
		c.T.Fatalf("last line of attach is not an NBD unix URI: %q", r.Stdout)
	}
	return uri
}

// URIPrefix starts the URI of an export on a unix socket.
const URIPrefix = "nbd+unix:///?socket="

// SocketOf is the unix socket of an nbd+unix URI.
func SocketOf(uri string) string { return strings.TrimPrefix(uri, URIPrefix) }

// Record is what `eli list --json` says about an attached volume (the fields tests use).
type Record struct {
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

// List is `eli list --json`.
func (c *CLI) List() []Record {
	c.T.Helper()
	r := c.Run("", "list", "--json")
	if r.Code != 0 {
		c.T.Errorf("eli list --json: %v", r)
		return nil
	}
	var recs []Record
	if err := json.Unmarshal([]byte(r.Stdout), &recs); err != nil {
		c.T.Errorf("eli list --json: %v\n%s", err, r.Stdout)
	}
	return recs
}

// Attached returns the record of name, failing the test when it is not attached.
func (c *CLI) Attached(name string) Record {
	c.T.Helper()
	for _, r := range c.List() {
		if r.Name == name {
			return r
		}
	}
	c.T.Fatalf("%s is not attached", name)
	return Record{}
}

// DetachAll stops every server of this state directory, even a wedged one: a failing
// test must not leave servers behind.
func (c *CLI) DetachAll() {
	for _, r := range c.List() {
		c.Run("", "detach", "--force", "--timeout", "20s", r.Name)
	}
}

// FileHash is the SHA-256 of a file's contents, to show that a command changed nothing.
func FileHash(t testing.TB, path string) [32]byte {
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

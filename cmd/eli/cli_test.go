package main

// These tests run the real eli binary, built once in TestMain, the way users and scripts
// do: arguments, passphrase files, stdin, a pseudo-terminal, exit codes and the one line
// on stderr that explains a failure.

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/nbdclient"
)

var eliBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "eli-cli-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if eliBin, err = elitest.Build(dir, "."); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// env is one test's world: a directory, a state directory and a passphrase file.
type env struct {
	*elitest.CLI
	t *testing.T
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	return &env{CLI: elitest.New(t, eliBin, dir, filepath.Join(dir, "state")), t: t}
}

func (e *env) initVolume(name, size string, extra ...string) string {
	e.t.Helper()
	p := e.Path(name)
	args := append([]string{"init", "--size", size, "--passphrase-file", e.Pass}, elitest.QuickKDF...)
	e.OK(append(append(args, extra...), p)...)
	return p
}

// attach attaches provider and returns its socket.
func (e *env) attach(provider string, extra ...string) string {
	e.t.Helper()
	return elitest.SocketOf(e.Attach(provider, extra...))
}

func dial(t *testing.T, socket string) *nbdclient.Client {
	t.Helper()
	c, err := nbdclient.Dial("unix", socket, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestUsageErrorsExit2(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, tc := range []struct {
		want string
		args []string
	}{
		{"unknown command", []string{"frobnicate"}},
		{"unknown flag", []string{"init", "--frobnicate", "x"}},
		{"takes 1 argument", []string{"init"}},
		{"takes 1 argument", []string{"attach", "a", "b"}},
		{"--sector-size 1000", []string{"init", "--sector-size", "1000", "--size", "1M", "x.img"}},
		{"UNSAFE", []string{"init", "--cipher", "chacha20-xts", "--size", "16M", "x.img"}},
		{"unknown cipher mode", []string{"init", "--cipher", "rot13", "x.img"}},
		{"invalid size", []string{"init", "--size", "lots", "x.img"}},
		{"--slot N is required", []string{"delkey", "x.img"}},
		{"--listen without TLS", []string{"attach", "--listen", "127.0.0.1:0", "x.img"}},
		{"--reencrypt-max-rate", []string{"attach", "--reencrypt-max-rate", "fast", "x.img"}},
		{"--key-length", []string{"init", "--key-length", "128", "x.img"}},
		{"KDF parameters out of range", []string{"init", "--kdf-time", "5000", "--size", "16M", "x.img"}},
		{"takes 1 argument", []string{"label"}}, // geli's names: label is init, stop is detach
		{"takes 1 argument", []string{"stop"}},
		{"suspend takes NAME|PROVIDER, or --all", []string{"suspend"}},
		{"suspend takes NAME|PROVIDER, or --all", []string{"suspend", "--all", "x"}},
		{"takes 1 argument", []string{"resume"}},
		{"--slot must be 0 to 7", []string{"resume", "--slot", "9", "x"}},
	} {
		e.FailsCode(2, tc.want, tc.args...)
	}
	if _, err := os.Stat(e.Path("x.img")); err == nil {
		t.Fatal("a refused init created its provider")
	}
}

func TestInitErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.FailsCode(1, "does not exist; give --size", "init", "--passphrase-file", e.Pass, e.Path("missing.img"))
	e.FailsCode(1, "provider too small", append(append([]string{"init", "--passphrase-file", e.Pass}, elitest.QuickKDF...), "--size", "100K", e.Path("tiny.img"))...)

	img := e.initVolume("a.img", "16M")
	before := elitest.FileHash(t, img)
	e.FailsCode(1, "already holds eli volume", append(append([]string{"init", "--passphrase-file", e.Pass}, elitest.QuickKDF...), img)...)
	if elitest.FileHash(t, img) != before {
		t.Fatal("refused init changed the provider")
	}
	e.OK(append(append([]string{"init", "--force", "--passphrase-file", e.Pass}, elitest.QuickKDF...), img)...)
	if elitest.FileHash(t, img) == before {
		t.Fatal("init --force did not write a new volume")
	}
	e.FailsCode(1, "empty", append(append([]string{"init", "--passphrase-file", e.Write("empty", "\n")}, elitest.QuickKDF...), "--size", "16M", e.Path("e.img"))...)
}

func TestAttachListDetach(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("disk.img", "64M")
	sock := e.attach(img)
	st, err := os.Stat(sock)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket %s: %v, mode %v; want 0600", sock, err, st.Mode().Perm())
	}
	list := e.OK("list").Stdout
	if !strings.Contains(list, "disk.img") || !strings.Contains(list, "xchacha20-poly1305") || !strings.Contains(list, sock) {
		t.Fatalf("list does not show the volume:\n%s", list)
	}

	c := dial(t, sock)
	if c.Export.Flags&nbdclient.FlagSendFlush == 0 || c.Export.Flags&nbdclient.FlagSendTrim == 0 || c.Export.Flags&nbdclient.FlagCanMultiConn == 0 {
		t.Errorf("export flags %#x lack flush, trim or multi-conn", c.Export.Flags)
	}
	if c.Export.PreferredBlock != 4096 {
		t.Errorf("preferred block size %d, want the sector size", c.Export.PreferredBlock)
	}
	data := bytes.Repeat([]byte("attached!"), 1000)
	if err := c.WriteAt(data, 12345, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	c.Close()

	// A second attach of the same provider, by name or under another name, is refused
	// and leaves the first one serving.
	e.FailsCode(1, "already attached", "attach", "--passphrase-file", e.Pass, img)
	e.FailsCode(1, "already attached as disk.img", "attach", "--passphrase-file", e.Pass, "--name", "other", img)
	e.FailsCode(1, "is not attached", "detach", "nosuchname")

	e.OK("detach", "disk.img")
	if out := e.OK("list").Stdout; strings.Contains(out, "disk.img") {
		t.Fatalf("list still shows the volume after detach:\n%s", out)
	}
	if _, err := os.Stat(sock); err == nil {
		t.Fatal("socket left behind after detach")
	}

	sock = e.attach(img, "--readonly")
	c = dial(t, sock)
	got := make([]byte, len(data))
	if err := c.ReadAt(got, 12345); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("data after re-attach: %v", err)
	}
	if err := c.WriteAt(data, 0, false); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("write to a read-only attach: %v, want EPERM", err)
	}
	c.Close()
	e.OK("detach", img) // by provider path
}

func TestWrongCredentials(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := e.Write("key", "keyfile contents")
	img := e.initVolume("k.img", "16M", "--keyfile", key)
	before := elitest.FileHash(t, img)
	e.FailsCode(1, "wrong passphrase or keyfile", "attach", "--passphrase-file", e.Write("bad", "wrong\n"), "--keyfile", key, img)
	e.FailsCode(1, "wrong passphrase or keyfile", "attach", "--passphrase-file", e.Pass, "--keyfile", e.Write("badkey", "other"), img)
	e.FailsCode(1, "wrong passphrase or keyfile", "attach", "--passphrase-file", e.Pass, img)
	e.FailsCode(1, "no terminal", "attach", "--keyfile", key, img)
	if elitest.FileHash(t, img) != before {
		t.Fatal("failed attaches changed the provider")
	}
	// The passphrase can come from standard input.
	r := e.Run("correct horse battery staple\n", "attach", "--passphrase-file", "-", "--keyfile", key, img)
	if r.Code != 0 {
		t.Fatalf("attach with the passphrase on stdin: %v", r)
	}
	e.OK("detach", "k.img")
}

func TestNotELIProvider(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	f := e.Path("plain.img")
	if err := os.WriteFile(f, bytes.Repeat([]byte{0xab}, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	before := elitest.FileHash(t, f)
	e.FailsCode(1, "not an eli provider", "attach", "--passphrase-file", e.Pass, f)
	e.FailsCode(1, "not an eli provider", "dump", f)
	e.FailsCode(1, "not an eli provider", "kill", "--yes", f)
	if elitest.FileHash(t, f) != before {
		t.Fatal("commands on a foreign provider changed it")
	}
}

func TestUnwritableSocket(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("s.img", "16M")
	before := elitest.FileHash(t, img)
	e.FailsCode(1, "listen", "attach", "--passphrase-file", e.Pass, "--socket", "/proc/eli-cannot-be-here.sock", img)
	if elitest.FileHash(t, img) != before {
		t.Fatal("failed attach changed the provider")
	}
	if out := e.OK("list").Stdout; strings.Contains(out, "s.img") {
		t.Fatal("failed attach left a record")
	}
	// The name is free again.
	e.attach(img)
	e.OK("detach", "s.img")
}

func TestKeyManagement(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("keys.img", "16M")
	newPass := e.Write("new", "second passphrase\n")
	r := e.OK(append([]string{"setkey", "--passphrase-file", e.Pass, "--new-passphrase-file", newPass}, append(elitest.QuickKDF, img)...)...)
	if !strings.Contains(r.Stdout, "keyslot 1 set") {
		t.Fatalf("setkey: %v", r)
	}
	dump := e.OK("dump", img).Stdout
	if !strings.Contains(dump, "2 active") {
		t.Fatalf("dump after setkey:\n%s", dump)
	}
	e.OK("delkey", "--slot", "0", img)
	e.FailsCode(1, "wrong passphrase", "attach", "--passphrase-file", e.Pass, img)
	r = e.OK("attach", "--passphrase-file", newPass, img)
	e.OK("detach", "keys.img")
	e.FailsCode(1, "last active keyslot", "delkey", "--slot", "1", img)
	e.FailsCode(1, "is empty", "delkey", "--slot", "3", img)

	// Backup, kill, restore: the data comes back.
	backup := e.Path("keys.backup")
	e.OK("backup", img, backup)
	e.FailsCode(1, "exists", "backup", img, backup)
	e.FailsCode(1, "no terminal", "kill", img)
	e.OK("kill", "--yes", img)
	e.FailsCode(1, "no active keyslot", "attach", "--passphrase-file", newPass, img)
	e.OK("restore", backup, img)
	e.OK("attach", "--passphrase-file", newPass, img)
	e.OK("detach", "keys.img")

	// A header backup of another volume is refused unless forced.
	other := e.initVolume("other.img", "16M")
	otherBackup := e.Path("other.backup")
	e.OK("backup", other, otherBackup)
	before := elitest.FileHash(t, img)
	e.FailsCode(1, "belongs to volume", "restore", otherBackup, img)
	if elitest.FileHash(t, img) != before {
		t.Fatal("refused restore changed the provider")
	}
	if !strings.Contains(e.OK("dump", otherBackup).Stdout, "backup") {
		t.Fatal("dump of a backup file does not say it is one")
	}
}

func TestDumpHasNoSecrets(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("d.img", "16M")
	out := e.OK("dump", img).Stdout
	for _, want := range []string{"xchacha20-poly1305", "sector size", "slot 0", "argon2id"} {
		if !strings.Contains(out, want) {
			t.Errorf("dump lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "correct horse") {
		t.Fatal("dump prints the passphrase")
	}
}

func TestOnetime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	scratch := e.Path("scratch.img")
	if err := os.WriteFile(scratch, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(scratch, 32<<20); err != nil {
		t.Fatal(err)
	}
	r := e.OK("onetime", scratch)
	sock := strings.TrimPrefix(strings.TrimSpace(r.Stdout), "nbd+unix:///?socket=")
	c := dial(t, sock)
	data := bytes.Repeat([]byte{7}, 8192)
	if err := c.WriteAt(data, 4096, true); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8192)
	if err := c.ReadAt(got, 4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("onetime read back: %v", err)
	}
	c.Close()
	e.OK("detach", "scratch.img")
	e.FailsCode(1, "not an eli provider", "dump", scratch)

	img := e.initVolume("vol.img", "16M")
	e.FailsCode(1, "onetime would destroy it", "onetime", img)
}

func TestResize(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("grow.img", "16M")
	sock := e.attach(img)
	c := dial(t, sock)
	size := c.Export.Size
	data := bytes.Repeat([]byte("before resize "), 300)
	off := int64(size) - int64(len(data)) - 4096
	if err := c.WriteAt(data, off, true); err != nil {
		t.Fatal(err)
	}
	c.Close()
	e.FailsCode(1, "in use", "resize", "--passphrase-file", e.Pass, "--size", "32M", img)
	e.OK("detach", "grow.img")
	e.OK("resize", "--passphrase-file", e.Pass, "--size", "32M", img)
	if st, _ := os.Stat(img); st.Size() != 32<<20 {
		t.Fatalf("provider is %d bytes after resize", st.Size())
	}
	sock = e.attach(img)
	c = dial(t, sock)
	if c.Export.Size <= size+15<<20 {
		t.Fatalf("size after resize %d, before %d", c.Export.Size, size)
	}
	got := make([]byte, len(data))
	if err := c.ReadAt(got, off); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("data before the old end after resize: %v", err)
	}
	// The new area, including where the old header copy B was, reads as zeroes.
	tail := make([]byte, 1<<20)
	if err := c.ReadAt(tail, int64(size)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(tail, make([]byte, len(tail))) {
		t.Fatal("new area after resize is not zero")
	}
	c.Close()
	e.OK("detach", "grow.img")
	e.FailsCode(1, "refusing to shrink", "resize", "--passphrase-file", e.Pass, "--size", "16M", img)
}

// TestKilledServerLeavesNoBlock: a server killed with SIGKILL leaves its socket and state
// file behind; list forgets it and the next attach of the same provider works.
func TestKilledServerLeavesNoBlock(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("kill9.img", "16M")
	e.attach(img)
	pid := 0
	for _, line := range strings.Split(e.OK("list").Stdout, "\n") {
		if f := strings.Fields(line); len(f) >= 6 && f[0] == "kill9.img" {
			fmt.Sscan(f[len(f)-2], &pid)
		}
	}
	if pid == 0 {
		t.Fatal("no pid in list")
	}
	syscall.Kill(pid, syscall.SIGKILL)
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if out := e.OK("list").Stdout; strings.Contains(out, "kill9.img") {
		t.Fatalf("list shows a killed server:\n%s", out)
	}
	e.attach(img)
	e.OK("detach", "kill9.img")
}

func TestUnsafeModeWarnsOnAttach(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("u.img", "16M", "--cipher", "chacha20-xts", "--unsafe")
	r := e.OK("attach", "--passphrase-file", e.Pass, img)
	if !strings.Contains(r.Stderr, "UNSAFE") {
		t.Fatalf("attach of an unsafe volume does not warn: %v", r)
	}
	e.OK("detach", "u.img")
}

func TestVersion(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.OK("version")
	if !strings.HasPrefix(r.Stdout, "eli ") {
		t.Fatalf("version: %v", r)
	}
	for _, want := range []string{"xchacha20-poly1305: ", "aes-xts: ", "chacha20-xts: "} {
		if !strings.Contains(r.Stdout, want) {
			t.Errorf("version does not say which code runs %q:\n%s", want, r.Stdout)
		}
	}
}

// TestDemo runs README's first command: the end-to-end demonstration must work on any
// machine with nothing but the binary.
func TestDemo(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.OK("demo", "--dir", e.Dir)
	for _, want := range []string{"eli init", "eli attach", "identical", "holds no plaintext", "the data is intact", "input/output error", "==> done"} {
		if !strings.Contains(r.Stdout, want) {
			t.Errorf("demo output lacks %q:\n%s", want, r.Stdout)
		}
	}
	if out := e.OK("list").Stdout; strings.Contains(out, "demo") {
		t.Errorf("demo left a volume attached:\n%s", out)
	}
}

// TestDemoModeNone: the demo runs for a mode without encryption too, and says the
// plaintext is on the provider instead of failing on it.
func TestDemoModeNone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.OK("demo", "--cipher", "none", "--dir", e.Dir)
	for _, want := range []string{"does not encrypt", "the data is intact", "==> done"} {
		if !strings.Contains(r.Stdout, want) {
			t.Errorf("demo --cipher none output lacks %q:\n%s", want, r.Stdout)
		}
	}
}

func TestCompletion(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, shell := range []string{"bash", "zsh", "fish"} {
		if r := e.OK("completion", shell); !strings.Contains(r.Stdout, "eli") || len(r.Stdout) < 500 {
			t.Errorf("completion %s: %d bytes", shell, len(r.Stdout))
		}
	}
	// The flag completion offers the cipher modes.
	r := e.OK("__complete", "init", "--cipher", "")
	if !strings.Contains(r.Stdout, "xchacha20-poly1305") || !strings.Contains(r.Stdout, "aes-xts") {
		t.Errorf("--cipher completion: %s", r.Stdout)
	}
}

// TestFormatVersions: init makes format version 2 for xchacha20-poly1305 unless --format 1
// asks otherwise; dump shows the version, and for version 2 the generation and root of the
// newest journal slot, marked unverified; --format 2 is refused for length-preserving modes.
func TestFormatVersions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("v2.img", "16M")
	out := e.OK("dump", img).Stdout
	if !strings.Contains(out, "version:        2\n") || !strings.Contains(out, "generation:     0 (never written)") {
		t.Fatalf("dump of a new default volume:\n%s", out)
	}
	sock := e.attach(img)
	if out := e.OK("list").Stdout; !strings.Contains(out, "xchacha20-poly1305 v2") {
		t.Errorf("list does not say the volume is format version 2:\n%s", out)
	}
	if out := e.OK("list", "--json").Stdout; !strings.Contains(out, `"format": 2`) {
		t.Errorf("list --json has no format 2:\n%s", out)
	}
	c := dial(t, sock)
	if err := c.WriteAt(bytes.Repeat([]byte("v2"), 5000), 4096, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	e.OK("detach", "v2.img")
	out = e.OK("dump", img).Stdout
	if !strings.Contains(out, "(unverified: read without the key)") || !strings.Contains(out, "tree root:") || strings.Contains(out, "generation:     0") {
		t.Fatalf("dump after a write:\n%s", out)
	}
	v1 := e.initVolume("v1.img", "16M", "--format", "1")
	out = e.OK("dump", v1).Stdout
	if !strings.Contains(out, "version:        1\n") || strings.Contains(out, "generation") {
		t.Fatalf("dump of a --format 1 volume:\n%s", out)
	}
	e.FailsCode(2, "authenticated modes", append([]string{"init", "--passphrase-file", e.Pass, "--size", "16M", "--cipher", "aes-xts", "--format", "2"}, append(elitest.QuickKDF, e.Path("x.img"))...)...)
}

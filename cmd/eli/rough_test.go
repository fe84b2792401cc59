package main

// Tests of the CLI's rough edges: init over killed and damaged volumes, what a failed init
// leaves behind, one short-flag scheme, mode none, and the messages users meet.

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/layout"
	"github.com/spf13/pflag"
)

func (e *env) initArgs(extra ...string) []string {
	return append(append([]string{"init", "--passphrase-file", e.Pass}, elitest.QuickKDF...), extra...)
}

// flipAt XORs one byte of the file at path.
func flipAt(t *testing.T, path string, off int64) {
	t.Helper()
	if err := flipByte(path, off); err != nil {
		t.Fatal(err)
	}
}

func size(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// After 'eli kill' nothing can decrypt the volume: init takes the provider without
// --force, and says what it replaces.
func TestInitOverKilledVolume(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("k.img", "16M")
	e.OK("kill", "--yes", img)
	r := e.OK(e.initArgs(img)...)
	if !strings.Contains(r.Stdout, "killed") || !strings.Contains(r.Stdout, "initialized") {
		t.Fatalf("init over a killed volume: %v", r)
	}
	e.attach(img)
	e.OK("detach", "k.img")
}

// Without --force init refuses whatever looks like a damaged eli volume, changes nothing
// and points to eli restore; --force overwrites it.
func TestInitRefusesDamagedVolume(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, img string)
		want   string
	}{
		{"copy A corrupt, copy B missing", func(t *testing.T, img string) {
			flipAt(t, img, 200)
			if err := os.Truncate(img, size(t, img)-4096); err != nil {
				t.Fatal(err)
			}
		}, "eli restore"},
		{"both copies corrupt", func(t *testing.T, img string) {
			flipAt(t, img, 200)
			flipAt(t, img, layout.HeaderBOffset(size(t, img))+200)
		}, "eli restore"},
		{"copy A's magic gone, copy B missing", func(t *testing.T, img string) {
			flipAt(t, img, 1)
			flipAt(t, img, 2)
			if err := os.Truncate(img, size(t, img)+1<<20); err != nil {
				t.Fatal(err)
			}
		}, "looks like a damaged eli volume"},
		{"both magics gone", func(t *testing.T, img string) {
			flipAt(t, img, 0)
			flipAt(t, img, layout.HeaderBOffset(size(t, img)))
		}, "looks like a damaged eli volume"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			img := e.initVolume("d.img", "16M")
			tc.damage(t, img)
			before := elitest.FileHash(t, img)
			r := e.FailsCode(1, tc.want, e.initArgs(img)...)
			if !strings.Contains(r.Stderr, "eli restore") || !strings.Contains(r.Stderr, "--force") {
				t.Fatalf("the refusal does not point to eli restore and --force: %v", r)
			}
			if elitest.FileHash(t, img) != before {
				t.Fatal("refused init changed the provider")
			}
			e.OK(e.initArgs("--force", img)...)
		})
	}
}

// A failed init --size removes the file it created (and only that).
func TestFailedInitRemovesCreatedFile(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	empty := e.Write("empty", "\n")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"too small", []string{"init", "--passphrase-file", e.Pass, "--size", "100K"}, "too small"},
		{"empty passphrase", []string{"init", "--passphrase-file", empty, "--size", "16M"}, "empty passphrase"},
		{"missing passphrase file", []string{"init", "--passphrase-file", e.Path("nope"), "--size", "16M"}, "no such file"},
	} {
		img := e.Path(strings.ReplaceAll(tc.name, " ", "-") + ".img")
		e.FailsCode(1, tc.want, append(append(tc.args, elitest.QuickKDF...), img)...)
		if _, err := os.Stat(img); !os.IsNotExist(err) {
			t.Errorf("%s: a failed init left %s behind (%v)", tc.name, img, err)
		}
	}
	// A file that existed before is kept.
	keep := e.Write("keep.img", "")
	e.FailsCode(1, "empty passphrase", append(append([]string{"init", "--passphrase-file", empty, "--size", "16M"}, elitest.QuickKDF...), keep)...)
	if _, err := os.Stat(keep); err != nil {
		t.Fatalf("a failed init removed a file it did not create: %v", err)
	}

	// Typed passphrases that differ, and an empty one, which is refused at the first
	// prompt without asking again.
	img := e.Path("tty.img")
	out, code := e.runOnTerminal([]string{"one", "two"}, append(append([]string{"init", "--size", "16M"}, elitest.QuickKDF...), img)...)
	if code != 1 || !strings.Contains(out, "do not match") {
		t.Fatalf("mismatched passphrases: exit %d:\n%s", code, out)
	}
	if _, err := os.Stat(img); !os.IsNotExist(err) {
		t.Fatalf("init with mismatched passphrases left %s behind (%v)", img, err)
	}
	out, code = e.runOnTerminal([]string{""}, append(append([]string{"init", "--size", "16M"}, elitest.QuickKDF...), img)...)
	if code != 1 || !strings.Contains(out, "empty passphrase") || strings.Contains(out, "Reenter") {
		t.Fatalf("an empty typed passphrase: exit %d:\n%s", code, out)
	}
	if _, err := os.Stat(img); !os.IsNotExist(err) {
		t.Fatalf("init with an empty passphrase left %s behind (%v)", img, err)
	}
}

// Every short flag means one long flag in every command, and the credential flags are
// -j, -k, -p wherever they exist.
func TestShortFlagsConsistent(t *testing.T) {
	t.Parallel()
	seen := map[string]string{} // shorthand -> "long (command)"
	for _, c := range newRootCmd().Commands() {
		c.Flags().VisitAll(func(f *pflag.Flag) {
			if f.Shorthand == "" {
				return
			}
			if prev, ok := seen[f.Shorthand]; ok && !strings.HasPrefix(prev, f.Name+" ") {
				t.Errorf("-%s is --%s in %s, but %s", f.Shorthand, f.Name, c.Name(), prev)
			}
			seen[f.Shorthand] = f.Name + " (" + c.Name() + ")"
		})
	}
	for _, name := range []string{"init", "attach", "setkey", "resize", "reencrypt"} {
		c, _, err := newRootCmd().Find([]string{name})
		if err != nil {
			t.Fatal(err)
		}
		for long, short := range map[string]string{"passphrase-file": "j", "keyfile": "k", "no-passphrase": "p"} {
			if f := c.Flags().Lookup(long); f == nil || f.Shorthand != short {
				t.Errorf("%s --%s: want -%s, got %+v", name, long, short, f)
			}
		}
	}
}

func TestCipherNoneNeedsUnsafe(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.Path("none.img")
	e.FailsCode(2, "does NOT encrypt", e.initArgs("--cipher", "none", "--size", "16M", img)...)
	if _, err := os.Stat(img); !os.IsNotExist(err) {
		t.Fatal("a refused init created its provider")
	}
	r := e.OK(e.initArgs("--cipher", "none", "--unsafe", "--size", "16M", img)...)
	if !strings.Contains(r.Stderr, "does NOT encrypt") {
		t.Fatalf("init --cipher none does not warn: %v", r)
	}
	scratch := e.Write("scratch.img", "")
	if err := os.Truncate(scratch, 16<<20); err != nil {
		t.Fatal(err)
	}
	e.FailsCode(2, "does NOT encrypt", "onetime", "--cipher", "none", scratch)
	// Every attach of such a volume says it again.
	r = e.OK("attach", "--passphrase-file", e.Pass, img)
	if !strings.Contains(r.Stderr, "does NOT encrypt") {
		t.Errorf("attach of a mode none volume does not warn: %v", r)
	}
	e.OK("detach", img)
}

func TestMessages(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("m.img", "16M")
	for _, tc := range []struct {
		want string
		args []string
	}{
		{"--slot 8 is out of range: keyslots are 0 to 7", []string{"delkey", "--slot", "8", img}},
		{"--slot N is required", []string{"delkey", img}},
		{"--kdf-memory 100000: the format allows at most 4096 MiB", e.initArgs("--kdf-memory", "100000", "--force", img)},
		{"--kdf-threads 300: the format allows 1 to 255", e.initArgs("--kdf-threads", "300", "--force", img)},
		{"--kdf-threads 20 is more than the limit of 16", e.initArgs("--kdf-threads", "20", "--force", img)},
		{"more than the limit of 32 GiB × passes; --kdf-allow-expensive", e.initArgs("--kdf-time", "100", "--kdf-memory", "4000", "--force", img)},
	} {
		e.FailsCode(2, tc.want, tc.args...)
	}

	if h := e.OK("init", "--help").Stdout; !strings.Contains(h, "towards 256") || !strings.Contains(h, "--kdf-allow-expensive") {
		t.Errorf("init --help does not state the calibrated KDF default and the limits:\n%s", h)
	}
	if h := e.OK("bench", "--help").Stdout; strings.Contains(h, ") (default") {
		t.Errorf("bench --help states a default twice:\n%s", h)
	}

	// A missing copy B is reported once, in the dump itself.
	if err := os.Truncate(img, size(t, img)+1<<20); err != nil {
		t.Fatal(err)
	}
	r := e.OK("dump", img)
	if n := strings.Count(r.Stdout+r.Stderr, "provider's size changed"); n != 1 {
		t.Errorf("dump reports the missing copy B %d times: %v", n, r)
	}
	// Both copies corrupt: "restore" is advised once.
	both := e.initVolume("both.img", "16M")
	flipAt(t, both, 200)
	flipAt(t, both, layout.HeaderBOffset(size(t, both))+200)
	r = e.FailsCode(1, "eli restore", "dump", both)
	if n := strings.Count(r.Stderr, "backup"); n != 1 {
		t.Errorf("the error advises restore %d times: %v", n, r)
	}
}

// A provider this user may only read: commands that write say to use --readonly instead
// of a bare "permission denied". Root may write anything, so as root the command runs
// as nobody.
func TestReadOnlyProviderMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("ro.img", "16M")
	cmd := e.Command("setkey", "--passphrase-file", e.Pass, "--new-passphrase-file", e.Pass, img)
	if os.Getuid() == 0 {
		for _, p := range []string{filepath.Dir(eliBin), e.Dir, filepath.Dir(e.Dir), e.Pass, img} {
			if err := os.Chmod(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(img, 0o644); err != nil {
			t.Fatal(err)
		}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	} else if err := os.Chmod(img, 0o444); err != nil {
		t.Fatal(err)
	}
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || !strings.Contains(string(out), "--readonly") {
		t.Fatalf("setkey on a read-only provider: %v:\n%s", err, out)
	}
}

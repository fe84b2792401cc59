package main

// The key sources a service uses (systemd credentials, key commands, the password
// agent), through the real binary, as the generated units run it.

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/elitest"
)

// runEnv runs eli with extra environment variables.
func (e *env) runEnv(extra []string, args ...string) elitest.Result {
	e.t.Helper()
	cmd := e.Command(args...)
	cmd.Env = append(cmd.Env, extra...)
	return runCmd(e.t, cmd)
}

// runCmd runs cmd and returns what it did.
func runCmd(t *testing.T, cmd *exec.Cmd) elitest.Result {
	t.Helper()
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return elitest.Result{Code: code, Stdout: out.String(), Stderr: errb.String()}
}

func TestCredentialAndKeyCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	keyData := "a key\x00 with a NUL and a newline\n"
	key := e.Write("data.key", keyData)
	img := e.Path("k.img")
	e.OK(append(append([]string{"init", "--size", "16M", "--keyfile", key, "--no-passphrase"}, elitest.QuickKDF...), img)...)

	creds := t.TempDir()
	if err := os.WriteFile(filepath.Join(creds, "data.key"), []byte(keyData), 0o400); err != nil {
		t.Fatal(err)
	}
	r := e.runEnv([]string{"CREDENTIALS_DIRECTORY=" + creds}, "attach", "--credential", "data.key", "--no-passphrase", img)
	if r.Code != 0 {
		t.Fatalf("attach with a credential: %v", r)
	}
	e.OK("detach", "k.img")

	// Without -p the volume's keyslots decide: this one has no passphrase to ask for.
	r = e.runEnv([]string{"CREDENTIALS_DIRECTORY=" + creds}, "attach", "--credential", "data.key", img)
	if r.Code != 0 {
		t.Fatalf("attach with a credential, no -p: %v", r)
	}
	e.OK("detach", "k.img")

	unlock := e.Write("unlock.sh", "#!/bin/sh\necho \"unlocking $1\" >&2\nexec cat \"$1\"\n")
	os.Chmod(unlock, 0o755)
	e.OK("attach", "--key-command", "'"+unlock+"' "+key, "--no-passphrase", img)
	e.OK("detach", "k.img")

	e.FailsCode(1, "wrong passphrase or keyfile", "attach", "--key-command", "printf other", "-p", img)
	e.FailsCode(1, "key command sh -c 'exit 7' failed (exit status 7)", "attach", "--key-command", "sh -c 'exit 7'", "-p", img)
	e.FailsCode(1, "did not finish in time and was killed", "attach", "--key-command", "sleep 30", "--key-timeout", "200ms", "-p", img)
	e.FailsCode(1, "systemd credential data.key: $CREDENTIALS_DIRECTORY is not set", "attach", "--credential", "data.key", "-p", img)
	r = e.runEnv([]string{"CREDENTIALS_DIRECTORY=" + creds}, "attach", "--credential", "other", "-p", img)
	if r.Code != 1 || !strings.Contains(r.Stderr, "systemd credential other: not in "+creds+": the unit needs LoadCredential=other") {
		t.Errorf("a missing credential: %v", r)
	}
}

func TestKeySourceUsageErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("u.img", "16M")
	for _, tc := range []struct {
		want string
		args []string
	}{
		{"--ask-password and a passphrase file exclude each other", []string{"--ask-password", "-j", e.Pass}},
		{"--no-passphrase and --ask-password exclude each other", []string{"--ask-password", "-p", "-k", e.Pass}},
		{"--no-passphrase needs at least one --keyfile, --credential or --key-command", []string{"-p"}},
		{"--key-command: key command \"a 'b\": a ' is not closed", []string{"--key-command", "a 'b", "-p"}},
		{"--key-command: empty key command", []string{"--key-command", " ", "-p"}},
		{"--key-timeout must be positive", []string{"--key-command", "true", "--key-timeout", "0s", "-p"}},
		{"--tries must be 1 to 100", []string{"--tries", "101", "-j", e.Pass}},
	} {
		e.FailsCode(2, tc.want, append(append([]string{"attach"}, tc.args...), img)...)
	}
	e.FailsCode(2, "--ask-password unlocks; a new passphrase comes from the terminal or a file",
		append(append([]string{"init", "--ask-password", "--size", "16M"}, elitest.QuickKDF...), e.Path("new.img"))...)
}

// TestAskPasswordTries: --ask-password asks systemd-ask-password (here a stand-in on
// $PATH that answers wrong, then right); --tries gives a person another go.
func TestAskPasswordTries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("a.img", "16M")
	bin := t.TempDir()
	count := filepath.Join(bin, "count")
	// Arguments go to a file, so that the test sees the question asked.
	fake := "#!/bin/sh\necho \"$@\" >> " + filepath.Join(bin, "args") + "\n" +
		"n=$(cat " + count + " 2>/dev/null || echo 0); echo $((n+1)) > " + count + "\n" +
		"if [ \"$n\" = 0 ]; then echo 'wrong guess'; else echo '" + elitest.Passphrase + "'; fi\n"
	if err := os.WriteFile(filepath.Join(bin, "systemd-ask-password"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	path := "PATH=" + bin + ":" + os.Getenv("PATH")

	r := e.runEnv([]string{path}, "attach", "--ask-password", "--tries", "1", img)
	if r.Code != 1 || !strings.Contains(r.Stderr, "wrong passphrase or keyfile") {
		t.Fatalf("a wrong answer with --tries 1: %v", r)
	}
	os.Remove(count)
	r = e.runEnv([]string{path}, "attach", "--ask-password", "--tries", "2", "--name", "vol", "--key-timeout", "42s", img)
	if r.Code != 0 || !strings.Contains(r.Stderr, "eli: warning: wrong passphrase or keyfile; 1 more tries") {
		t.Fatalf("a wrong, then a right answer with --tries 2: %v", r)
	}
	e.OK("detach", "vol")
	args, _ := os.ReadFile(filepath.Join(bin, "args"))
	if want := "--timeout=42 --icon=drive-harddisk --id=eli:vol Passphrase for eli volume vol:"; !strings.Contains(string(args), want) {
		t.Errorf("systemd-ask-password was asked %q; want %q", args, want)
	}
}

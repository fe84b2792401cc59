package keysource

import (
	"bytes"
	"context"
	"math/rand"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func write(t *testing.T, dir, name string, data []byte, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, mode); err != nil {
		t.Fatal(err)
	}
	return p
}

// wantErr checks that err says want.
func wantErr(t *testing.T, what string, got []byte, err error, want string) {
	t.Helper()
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("%s: %q, %v; want an error with %q", what, got, err, want)
	}
}

func TestKeyfileAndPassphraseFile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	bin := []byte{0, 1, 2, '\n', 0xff}
	key := write(t, dir, "key", bin, 0o600)
	if got, err := (Keyfile{Path: key}).Read(ctx); err != nil || !bytes.Equal(got, bin) {
		t.Errorf("keyfile: %q, %v", got, err)
	}
	for _, tc := range []struct{ content, want string }{
		{"pw\n", "pw"}, {"pw", "pw"}, {"pw\r\nsecond line\n", "pw"}, {"\n", ""}, {"", ""},
		{strings.Repeat("p", MaxPassphrase) + "\n", strings.Repeat("p", MaxPassphrase)},
		{strings.Repeat("p", MaxPassphrase) + "\r\n", strings.Repeat("p", MaxPassphrase)},
	} {
		p := write(t, dir, "pass", []byte(tc.content), 0o600)
		got, err := (PassphraseFile{Path: p}).Read(ctx)
		if err != nil || string(got) != tc.want {
			t.Errorf("passphrase file %q: %q, %v; want %q", tc.content, got, err, tc.want)
		}
	}
	p := write(t, dir, "long", []byte(strings.Repeat("p", MaxPassphrase+1)+"\n"), 0o600)
	got, err := (PassphraseFile{Path: p}).Read(ctx)
	wantErr(t, "a long passphrase", got, err, "longer than 4096 bytes")

	empty := write(t, dir, "empty", nil, 0o600)
	got, err = (Keyfile{Path: empty}).Read(ctx)
	wantErr(t, "an empty keyfile", got, err, "keyfile "+empty+" is empty")
	got, err = (Keyfile{Path: filepath.Join(dir, "missing")}).Read(ctx)
	wantErr(t, "a missing keyfile", got, err, "no such file")
	got, err = (Keyfile{Path: "/dev/zero"}).Read(ctx)
	wantErr(t, "/dev/zero", got, err, "keyfile /dev/zero is larger than 64 MiB")
}

func TestStdinGoesToOneSource(t *testing.T) {
	t.Parallel()
	s := &Stdin{}
	if err := s.Claim("passphrase file"); err != nil {
		t.Fatal(err)
	}
	_, err := (Keyfile{Path: "-", Stdin: s}).Read(context.Background())
	wantErr(t, "a second '-'", nil, err, "both passphrase file and keyfile - want standard input ('-'): only one can have it")
}

func TestCredential(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	write(t, dir, "data.key", []byte("sealed key\x00\n"), 0o400)
	write(t, dir, "empty", nil, 0o400)
	big, _ := os.Create(filepath.Join(dir, "big"))
	big.Truncate(MaxKey + 1)
	big.Close()

	t.Setenv(CredentialsEnv, dir)
	if got, err := (Credential{Name: "data.key"}).Read(ctx); err != nil || string(got) != "sealed key\x00\n" {
		t.Errorf("credential: %q, %v", got, err)
	}
	for _, tc := range []struct {
		c    Credential
		want string
	}{
		{Credential{Name: "missing"}, "systemd credential missing: not in " + dir + ": the unit needs LoadCredential=missing"},
		{Credential{Name: "empty"}, "systemd credential empty is empty"},
		{Credential{Name: "big"}, "systemd credential big is larger than 1 MiB"},
		{Credential{Name: "../data.key"}, `"../data.key" is not a credential name`},
		{Credential{Name: ".."}, `".." is not a credential name`},
		{Credential{Name: ""}, `"" is not a credential name`},
	} {
		got, err := tc.c.Read(ctx)
		wantErr(t, tc.c.Name, got, err, tc.want)
	}
	t.Setenv(CredentialsEnv, "")
	got, err := (Credential{Name: "data.key"}).Read(ctx)
	wantErr(t, "no $CREDENTIALS_DIRECTORY", got, err, "$CREDENTIALS_DIRECTORY is not set: a credential comes from systemd, in a service with LoadCredential=data.key:FILE")
	if got, err := (Credential{Name: "data.key", Dir: dir}).Read(ctx); err != nil || len(got) != 12 {
		t.Errorf("credential from Dir: %q, %v", got, err)
	}
}

func TestCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	var stderr bytes.Buffer
	script := write(t, dir, "unlock", []byte("#!/bin/sh\necho \"unlocking $1\" >&2\nprintf 'key for %s' \"$1\"\n"), 0o755)
	got, err := Command{Argv: []string{script, "data vol"}, Timeout: time.Minute, Stderr: &stderr}.Read(ctx)
	if err != nil || string(got) != "key for data vol" {
		t.Errorf("key command: %q, %v", got, err)
	}
	if stderr.String() != "unlocking data vol\n" {
		t.Errorf("key command's stderr went elsewhere: %q", stderr.String())
	}
	if got, err := (Command{Argv: []string{"printf", `\001\000`}, Timeout: time.Minute}).Read(ctx); err != nil || string(got) != "\x01\x00" {
		t.Errorf("a key command from $PATH: %q, %v", got, err)
	}

	for _, tc := range []struct {
		name string
		c    Command
		want string
	}{
		{"failing", Command{Argv: []string{"sh", "-c", "echo nope >&2; exit 3"}, Timeout: time.Minute, Stderr: &bytes.Buffer{}},
			"key command sh -c 'echo nope >&2; exit 3' failed (exit status 3); its messages, if any, are in the log above"},
		{"silent", Command{Argv: []string{"true"}, Timeout: time.Minute}, "key command true printed no key"},
		{"missing", Command{Argv: []string{filepath.Join(dir, "nothing")}, Timeout: time.Minute}, "no such file"},
		{"empty", Command{Timeout: time.Minute}, "empty key command"},
		{"no timeout", Command{Argv: []string{"true"}}, "no timeout: a key command must not wait forever"},
		{"too much", Command{Argv: []string{"head", "-c", "2000000", "/dev/zero"}, Timeout: time.Minute},
			"the output of key command head -c 2000000 /dev/zero is larger than 1 MiB"},
	} {
		got, err := tc.c.Read(ctx)
		wantErr(t, tc.name, got, err, tc.want)
	}
}

// TestCommandTimeoutKillsGroup: a key command that hangs, with a child that holds its
// output pipe, is killed with that child when its time is up; eli does not wait on.
func TestCommandTimeoutKillsGroup(t *testing.T) {
	t.Parallel()
	pidFile := filepath.Join(t.TempDir(), "pid")
	c := Command{Argv: []string{"sh", "-c", "sleep 1000 & echo $! > " + pidFile + "; wait"}, Timeout: 300 * time.Millisecond}
	got, err := c.Read(context.Background())
	wantErr(t, "a hanging key command", got, err, "did not finish in time and was killed")
	b, rerr := os.ReadFile(pidFile)
	if rerr != nil {
		t.Fatal(rerr)
	}
	proc := "/proc/" + strings.TrimSpace(string(b))
	// The kill is delivered; a zombie may linger until init reaps it, but no sleep runs.
	for i := 0; i < 100; i++ {
		st, err := os.ReadFile(proc + "/stat")
		if err != nil || strings.Contains(string(st), ") Z ") {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Errorf("the key command's child %s still runs after the timeout", proc)
}

func TestSplitJoinCommand(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"clevis decrypt", []string{"clevis", "decrypt"}},
		{"  /usr/bin/x\t a  ", []string{"/usr/bin/x", "a"}},
		{`sh -c 'exec clevis decrypt < /etc/eli/d.jwe'`, []string{"sh", "-c", "exec clevis decrypt < /etc/eli/d.jwe"}},
		{`a "b \"c\" \\ d" e\ f 'g'"h"i`, []string{"a", `b "c" \ d`, "e f", "ghi"}},
		{`x '' ""`, []string{"x", "", ""}},
		{`x $HOME *`, []string{"x", "$HOME", "*"}},
		{`x "a\nb"`, []string{"x", `a\nb`}},
	} {
		got, err := SplitCommand(tc.in)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("SplitCommand(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{"", "empty key command"}, {"   ", "empty key command"},
		{"a 'b", "a ' is not closed"}, {`a "b`, `a " is not closed`}, {`a \`, "ends in a backslash"},
	} {
		got, err := SplitCommand(tc.in)
		wantErr(t, tc.in, []byte(strings.Join(got, " ")), err, tc.want)
	}
	r := rand.New(rand.NewSource(1))
	alphabet := []byte("ab /'\"\\$*\t\n-=%é")
	for i := 0; i < 2000; i++ {
		argv := make([]string, 1+r.Intn(4))
		for j := range argv {
			w := make([]byte, r.Intn(6))
			for k := range w {
				w[k] = alphabet[r.Intn(len(alphabet))]
			}
			argv[j] = string(w)
		}
		s := JoinCommand(argv)
		got, err := SplitCommand(s)
		if err != nil || !reflect.DeepEqual(got, argv) {
			t.Fatalf("JoinCommand(%q) = %q, which splits into %q, %v", argv, s, got, err)
		}
	}
}

package keysource

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// CredentialsEnv names the directory where systemd puts a service's credentials
// (LoadCredential=, LoadCredentialEncrypted=, SetCredential=; systemd.exec(5)).
const CredentialsEnv = "CREDENTIALS_DIRECTORY"

// Credential reads a systemd credential as a key: the file NAME in
// $CREDENTIALS_DIRECTORY, which systemd filled from LoadCredential=NAME:PATH (or from
// LoadCredentialEncrypted=, decrypting and authenticating it on the way, with the TPM
// if it was sealed to one: systemd-creds encrypt --with-key=tpm2).
type Credential struct {
	Name string
	// Dir is $CREDENTIALS_DIRECTORY when empty.
	Dir string
}

func (c Credential) Kind() Kind     { return AsKeyfile }
func (c Credential) String() string { return "systemd credential " + c.Name }

func (c Credential) Read(context.Context) ([]byte, error) {
	if c.Name == "" || c.Name == "." || c.Name == ".." || strings.ContainsAny(c.Name, "/\x00") {
		return nil, fmt.Errorf("%q is not a credential name (a file name, without '/')", c.Name)
	}
	dir := c.Dir
	if dir == "" {
		dir = os.Getenv(CredentialsEnv)
	}
	if dir == "" {
		return nil, fmt.Errorf("%s: $%s is not set: a credential comes from systemd, in a service with LoadCredential=%s:FILE or LoadCredentialEncrypted=%s:FILE",
			c, CredentialsEnv, c.Name, c.Name)
	}
	f, err := os.Open(filepath.Join(dir, c.Name))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%s: not in %s: the unit needs LoadCredential=%s (or LoadCredentialEncrypted=) and systemd must find it",
			c, dir, c.Name)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c, err)
	}
	defer f.Close()
	data, err := readAll(f, MaxKey, c.String())
	if err != nil {
		return nil, err
	}
	if len(data) == 0 {
		return nil, fmt.Errorf("%s is empty", c)
	}
	return data, nil
}

// Command runs a program and takes its standard output as a key: clevis decrypt (Tang,
// TPM2), a script that fetches a key, anything that prints one. It runs without a
// shell: Argv is the program (an absolute path, or a name looked up in $PATH) and its
// arguments, which are configuration, never a secret. Its standard input is /dev/null,
// its standard error goes to Stderr (the log), and it gets Timeout to finish, after
// which it and every process it started are killed.
type Command struct {
	Argv    []string
	Timeout time.Duration
	Stderr  io.Writer
	// Env is the environment; nil means this process's.
	Env []string
}

func (c Command) Kind() Kind { return AsKeyfile }
func (c Command) String() string {
	if len(c.Argv) == 0 {
		return "key command"
	}
	return "key command " + JoinCommand(c.Argv)
}

func (c Command) Read(ctx context.Context) ([]byte, error) {
	if len(c.Argv) == 0 || c.Argv[0] == "" {
		return nil, errors.New("empty key command")
	}
	if c.Timeout <= 0 {
		return nil, fmt.Errorf("%s: no timeout: a key command must not wait forever", c)
	}
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	out, err := runBounded(ctx, c.Argv, nil, c.Stderr, c.Env, MaxKey, c.String())
	if err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s printed no key", c)
	}
	return out, nil
}

// runBounded runs argv with stdin, its stderr to stderr, and returns its standard output
// (at most limit bytes). Past ctx's deadline it kills the process group, so that a
// program that started others cannot keep eli waiting on a pipe they inherited.
func runBounded(ctx context.Context, argv []string, stdin io.Reader, stderr io.Writer, env []string, limit int, what string) ([]byte, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin = stdin
	if stderr == nil {
		stderr = os.Stderr
	}
	cmd.Stderr = stderr
	cmd.Env = env
	cmd.SysProcAttr = processGroup()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			killGroup(cmd.Process.Pid)
		case <-done:
		}
	}()
	out, rerr := readAll(stdout, limit, "the output of "+what)
	if rerr != nil {
		killGroup(cmd.Process.Pid)
	}
	werr := cmd.Wait()
	close(done)
	if (rerr != nil || werr != nil) && ctx.Err() != nil {
		clear(out)
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return nil, fmt.Errorf("%s did not finish in time and was killed", what)
		}
		return nil, fmt.Errorf("%s: %w", what, ctx.Err())
	}
	if rerr != nil {
		return nil, rerr
	}
	if werr != nil {
		clear(out)
		var ee *exec.ExitError
		if errors.As(werr, &ee) {
			return nil, fmt.Errorf("%s failed (%s); its messages, if any, are in the log above", what, ee.ProcessState)
		}
		return nil, fmt.Errorf("%s: %w", what, werr)
	}
	return out, nil
}

// AskPassword asks for a passphrase through systemd's password agent
// (systemd-ask-password(1)): on the console, in Plymouth, or wherever an agent answers
// at boot (systemd-tty-ask-password-agent(1) later). It fails after Timeout.
type AskPassword struct {
	// ID identifies the question for agents ("eli:NAME").
	ID string
	// Message is the question, e.g. "Passphrase for eli volume data (/dev/sdb1):".
	Message string
	Timeout time.Duration
	// Program is systemd-ask-password when empty.
	Program string
	// Stdin is the program's standard input, os.Stdin when nil: on a terminal it asks
	// there, otherwise through the agents.
	Stdin io.Reader
}

func (a AskPassword) Kind() Kind     { return AsPassphrase }
func (a AskPassword) String() string { return "systemd's password agent" }

func (a AskPassword) Read(ctx context.Context) ([]byte, error) {
	prog := a.Program
	if prog == "" {
		prog = "systemd-ask-password"
	}
	path, err := exec.LookPath(prog)
	if err != nil {
		return nil, fmt.Errorf("%s is not installed: --ask-password needs systemd (or give another key source)", prog)
	}
	if a.Timeout <= 0 {
		return nil, errors.New("the password agent needs a timeout: nothing waits forever")
	}
	secs := int64((a.Timeout + time.Second - 1) / time.Second)
	argv := []string{path, "--timeout=" + strconv.FormatInt(secs, 10), "--icon=drive-harddisk"}
	if a.ID != "" {
		argv = append(argv, "--id="+a.ID)
	}
	argv = append(argv, a.Message)
	// systemd-ask-password enforces the timeout itself; ours is the backstop for an
	// agent protocol that never answers.
	ctx, cancel := context.WithTimeout(ctx, a.Timeout+5*time.Second)
	defer cancel()
	stdin := a.Stdin
	if stdin == nil {
		stdin = os.Stdin
	}
	out, err := runBounded(ctx, argv, stdin, os.Stderr, nil, MaxPassphrase+1, a.String())
	if err != nil {
		return nil, fmt.Errorf("no passphrase (timed out after %v, or cancelled): %w", a.Timeout, err)
	}
	// It ends the passphrase with a newline.
	if n := len(out); n > 0 && out[n-1] == '\n' {
		out[n-1] = 0
		out = out[:n-1]
	}
	if len(out) > MaxPassphrase {
		clear(out)
		return nil, fmt.Errorf("passphrase longer than %d bytes", MaxPassphrase)
	}
	if bytes.IndexByte(out, '\n') >= 0 {
		clear(out)
		return nil, errors.New("the password agent returned more than one line")
	}
	return out, nil
}

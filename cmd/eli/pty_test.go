package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
)

// runOnTerminal runs eli with a pseudo-terminal as its controlling terminal and answers
// each prompt in turn. It returns everything the terminal showed and the exit code.
func (e *env) runOnTerminal(answers []string, args ...string) (string, int) {
	e.t.Helper()
	m, s := elitest.OpenPTY(e.t)
	defer m.Close()
	cmd := e.Command(args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = s, s, s
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	s.Close()
	var shown bytes.Buffer
	r := bufio.NewReader(m)
	m.SetReadDeadline(time.Now().Add(30 * time.Second))
	for _, a := range answers {
		// Read until a prompt (it ends with ": ") shows, then type the answer.
		for !strings.HasSuffix(shown.String(), ": ") {
			b, err := r.ReadByte()
			if err != nil {
				cmd.Process.Kill()
				cmd.Wait()
				e.t.Fatalf("terminal closed before the prompt; it showed %q: %v", shown.String(), err)
			}
			shown.WriteByte(b)
		}
		fmt.Fprintf(m, "%s\r", a)
		shown.WriteString("<answered>")
	}
	// Drain until the process closes the terminal.
	for {
		b, err := r.ReadByte()
		if err != nil {
			break
		}
		shown.WriteByte(b)
	}
	err := cmd.Wait()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	}
	return shown.String(), code
}

func TestPassphrasePrompt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.Path("tty.img")
	args := append(append([]string{"init", "--size", "16M"}, elitest.QuickKDF...), img)

	out, code := e.runOnTerminal([]string{"typed secret", "typed secret"}, args...)
	if code != 0 {
		t.Fatalf("init on a terminal exited %d:\n%s", code, out)
	}
	if !strings.Contains(out, "Enter new passphrase: ") || !strings.Contains(out, "Reenter new passphrase: ") {
		t.Fatalf("init did not prompt twice:\n%s", out)
	}
	if strings.Contains(out, "typed secret") {
		t.Fatalf("the passphrase was echoed:\n%s", out)
	}

	// A mismatch is refused, and nothing is written.
	img2 := e.Path("tty2.img")
	out, code = e.runOnTerminal([]string{"one", "two"}, append(append([]string{"init", "--size", "16M"}, elitest.QuickKDF...), img2)...)
	if code != 1 || !strings.Contains(out, "do not match") {
		t.Fatalf("mismatched passphrases: exit %d:\n%s", code, out)
	}

	// The passphrase typed at init unlocks the volume, typed at attach's prompt.
	out, code = e.runOnTerminal([]string{"typed secret"}, "attach", img)
	if code != 0 || !strings.Contains(out, "Enter passphrase: ") || !strings.Contains(out, "nbd+unix://") {
		t.Fatalf("attach on a terminal exited %d:\n%s", code, out)
	}
	e.OK("detach", "tty.img")
	out, code = e.runOnTerminal([]string{"wrong"}, "attach", img)
	if code != 1 || !strings.Contains(out, "wrong passphrase") {
		t.Fatalf("attach with a wrong typed passphrase: exit %d:\n%s", code, out)
	}

	// kill asks for confirmation on the terminal.
	out, code = e.runOnTerminal([]string{"no"}, "kill", img)
	if code != 1 || !strings.Contains(out, "not confirmed") {
		t.Fatalf("kill answered 'no': exit %d:\n%s", code, out)
	}
	out, code = e.runOnTerminal([]string{"yes"}, "kill", img)
	if code != 0 {
		t.Fatalf("kill answered 'yes': exit %d:\n%s", code, out)
	}
}

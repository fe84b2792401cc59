package keysource

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/testtool"
)

// askDir is where systemd-ask-password leaves its questions for agents
// (https://systemd.io/PASSWORD_AGENTS/).
const askDir = "/run/systemd/ask-password"

// answer plays a password agent: it waits for the question with the given ID and sends
// reply ("+passphrase", or "-" to cancel) to the socket the question names.
func answer(t *testing.T, id, reply string) chan error {
	done := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			files, _ := filepath.Glob(filepath.Join(askDir, "ask.*"))
			for _, f := range files {
				socket, ok := question(f, id)
				if !ok {
					continue
				}
				c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: socket, Net: "unixgram"})
				if err != nil {
					done <- err
					return
				}
				_, err = c.Write([]byte(reply))
				c.Close()
				done <- err
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		done <- fmt.Errorf("no question with Id=%s appeared in %s", id, askDir)
	}()
	return done
}

// question reads an ask file and returns its socket if its Id is id.
func question(path, id string) (string, bool) {
	f, err := os.Open(path)
	if err != nil {
		return "", false
	}
	defer f.Close()
	var socket, got string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), "=")
		switch k {
		case "Socket":
			socket = v
		case "Id":
			got = v
		}
	}
	return socket, got == id && socket != ""
}

func TestAskPassword(t *testing.T) {
	t.Parallel()
	prog := testtool.Need(t, "systemd-ask-password", "systemd")
	testtool.NeedRoot(t) // the agents' directory is root's
	ctx := context.Background()
	id := func(what string) string {
		return fmt.Sprintf("eli:test-%s-%d-%d", what, os.Getpid(), time.Now().UnixNano())
	}
	ask := func(id string, timeout time.Duration) AskPassword {
		return AskPassword{ID: id, Message: "Passphrase for eli volume test:", Timeout: timeout, Program: prog, Stdin: strings.NewReader("")}
	}

	ok := id("ok")
	agent := answer(t, ok, "+correct horse")
	got, err := ask(ok, time.Minute).Read(ctx)
	if aerr := <-agent; aerr != nil {
		t.Fatal(aerr)
	}
	if err != nil || string(got) != "correct horse" {
		t.Errorf("answered: %q, %v", got, err)
	}

	cancelled := id("cancel")
	agent = answer(t, cancelled, "-")
	got, err = ask(cancelled, time.Minute).Read(ctx)
	if aerr := <-agent; aerr != nil {
		t.Fatal(aerr)
	}
	wantErr(t, "cancelled", got, err, "no passphrase (timed out after 1m0s, or cancelled)")

	start := time.Now()
	got, err = ask(id("unanswered"), time.Second).Read(ctx)
	wantErr(t, "unanswered", got, err, "no passphrase (timed out after 1s, or cancelled)")
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("an unanswered question took %v to give up; its timeout is 1s", d)
	}

	got, err = (AskPassword{Program: "eli-no-such-program", Timeout: time.Second}).Read(ctx)
	wantErr(t, "no program", got, err, "eli-no-such-program is not installed: --ask-password needs systemd")
	got, err = (AskPassword{Program: prog}).Read(ctx)
	wantErr(t, "no timeout", got, err, "needs a timeout")
}

// TestAskPasswordOutput: what the program prints is the passphrase, less its newline.
func TestAskPasswordOutput(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	fake := func(body string) string {
		return write(t, dir, fmt.Sprintf("ask%d", time.Now().UnixNano()), []byte("#!/bin/sh\n"+body+"\n"), 0o755)
	}
	ctx := context.Background()
	a := AskPassword{Timeout: time.Minute, Stdin: strings.NewReader("")}
	a.Program = fake(`printf 'pass word\n'`)
	if got, err := a.Read(ctx); err != nil || string(got) != "pass word" {
		t.Errorf("%q, %v", got, err)
	}
	a.Program = fake(`printf 'a\nb\n'`)
	got, err := a.Read(ctx)
	wantErr(t, "two lines", got, err, "more than one line")
	a.Program = fake(`head -c 5000 /dev/zero`)
	got, err = a.Read(ctx)
	wantErr(t, "too long", got, err, "larger than 4097 bytes")
	a.Program = fake(`exit 1`)
	got, err = a.Read(ctx)
	wantErr(t, "failed", got, err, "no passphrase (timed out after 1m0s, or cancelled)")
}

func TestPrompt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		p       Prompt
		typed   string
		want    string
		wantErr string
	}{
		{Prompt{Message: "Enter passphrase"}, "secret\n", "secret", ""},
		{Prompt{Message: "Enter new passphrase", Confirm: true}, "secret\nsecret\n", "secret", ""},
		{Prompt{Message: "Enter new passphrase", Confirm: true}, "secret\nsecreT\n", "", "passphrases do not match"},
		{Prompt{Message: "Enter passphrase"}, "\n", "", "empty passphrase"},
		{Prompt{Message: "Enter passphrase", AllowEmpty: true}, "\n", "", ""},
	} {
		m, s := elitest.OpenPTY(t)
		tc.p.Open = func() (io.ReadWriteCloser, int, error) { return s, int(s.Fd()), nil }
		go io.Copy(io.Discard, m) // what the terminal shows
		m.Write([]byte(tc.typed))
		got, err := tc.p.Read(context.Background())
		if tc.wantErr != "" {
			wantErr(t, tc.p.Message, got, err, tc.wantErr)
			continue
		}
		if err != nil || string(got) != tc.want {
			t.Errorf("%q typed: %q, %v; want %q", tc.typed, got, err, tc.want)
		}
	}
	p := Prompt{Message: "Enter passphrase", Open: func() (io.ReadWriteCloser, int, error) { return nil, -1, os.ErrNotExist }}
	got, err := p.Read(context.Background())
	wantErr(t, "no terminal", got, err, "no terminal to ask for the passphrase: give --passphrase-file FILE (or - for standard input), or --ask-password under systemd")
}

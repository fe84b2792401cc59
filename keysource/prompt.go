package keysource

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// OpenTerminal opens where prompts go: /dev/tty, so that a prompt works even when
// standard input and output are redirected. It returns the terminal and its descriptor.
func OpenTerminal() (io.ReadWriteCloser, int, error) {
	f, err := os.OpenFile("/dev/tty", os.O_RDWR, 0)
	if err != nil {
		return nil, -1, err
	}
	return f, int(f.Fd()), nil
}

// Prompt asks for a passphrase on the terminal, with echo off: twice when Confirm (a
// new key). An empty answer is refused unless AllowEmpty (keyfiles were given: an
// empty passphrase then means none).
type Prompt struct {
	Message    string // "Enter passphrase"
	Confirm    bool
	AllowEmpty bool
	// Open opens the terminal; nil means OpenTerminal.
	Open func() (io.ReadWriteCloser, int, error)
}

func (p Prompt) Kind() Kind     { return AsPassphrase }
func (p Prompt) String() string { return "the terminal" }

func (p Prompt) Read(context.Context) ([]byte, error) {
	open := p.Open
	if open == nil {
		open = OpenTerminal
	}
	tty, fd, err := open()
	if err != nil {
		return nil, errors.New("no terminal to ask for the passphrase: give --passphrase-file FILE (or - for standard input), or --ask-password under systemd")
	}
	defer tty.Close()
	p1, err := readNoEcho(tty, fd, p.Message+": ")
	if err != nil {
		return nil, err
	}
	if len(p1) == 0 && !p.AllowEmpty {
		return nil, ErrEmptyPassphrase
	}
	if !p.Confirm {
		return p1, nil
	}
	p2, err := readNoEcho(tty, fd, "Reenter "+lowerFirst(strings.TrimPrefix(p.Message, "Enter "))+": ")
	if err != nil {
		clear(p1)
		return nil, err
	}
	defer clear(p2)
	if !bytes.Equal(p1, p2) {
		clear(p1)
		return nil, errors.New("passphrases do not match")
	}
	return p1, nil
}

// readNoEcho turns echo off, then shows the prompt, then reads one line: in that order,
// so that nothing typed in answer to the prompt is ever echoed.
func readNoEcho(tty io.ReadWriter, fd int, prompt string) ([]byte, error) {
	old, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return nil, fmt.Errorf("terminal: %w", err)
	}
	t := *old
	t.Lflag &^= unix.ECHO
	t.Lflag |= unix.ICANON | unix.ISIG
	t.Iflag |= unix.ICRNL
	if err := unix.IoctlSetTermios(fd, unix.TCSETS, &t); err != nil {
		return nil, fmt.Errorf("terminal: %w", err)
	}
	defer func() {
		unix.IoctlSetTermios(fd, unix.TCSETS, old)
		fmt.Fprintln(tty)
	}()
	fmt.Fprint(tty, prompt)
	line := make([]byte, 0, MaxPassphrase) // never reallocated: no stray copies
	var b [1]byte
	for {
		n, err := tty.Read(b[:])
		if n == 1 {
			if b[0] == '\n' {
				return line, nil
			}
			if len(line) == MaxPassphrase {
				clear(line)
				return nil, fmt.Errorf("passphrase longer than %d bytes", MaxPassphrase)
			}
			line = append(line, b[0])
		}
		if err != nil {
			clear(line)
			if err == io.EOF {
				return nil, errors.New("read passphrase: terminal closed")
			}
			return nil, fmt.Errorf("read passphrase: %w", err)
		}
	}
}

func lowerFirst(s string) string {
	if s == "" || s[0] < 'A' || s[0] > 'Z' {
		return s
	}
	return string(s[0]+'a'-'A') + s[1:]
}

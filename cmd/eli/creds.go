package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// Bounds on what eli reads as credentials, so that `--keyfile /dev/zero` or a huge
// passphrase file is an error rather than an out-of-memory kill.
const (
	maxPassphrase = 4096
	maxKeyfile    = 64 << 20
)

// credFlags are the credential options a command takes, once for the key it unlocks
// with and, for setkey, once more for the key it sets.
type credFlags struct {
	passphraseFile string
	keyfiles       []string
	noPassphrase   bool
	// allowExpensive lifts keys.DefaultKDFLimits for the keyslots this command opens
	// and the one it creates (--kdf-allow-expensive).
	allowExpensive bool
}

// credentials are what the user supplied, read into memory. Wipe them when done.
type credentials struct {
	passphrase []byte // nil when none
	keyfiles   [][]byte
}

func (c *credentials) wipe() {
	if c == nil {
		return
	}
	clear(c.passphrase)
	for _, k := range c.keyfiles {
		clear(k)
	}
}

// openTerminal opens where prompts go. Tests replace it; the real one is /dev/tty, so that a
// prompt works even when stdin and stdout are redirected.
var openTerminal = func() (io.ReadWriteCloser, int, error) {
	f, err := os.OpenFile("/dev/tty", os.O_RDWR, 0)
	if err != nil {
		return nil, -1, err
	}
	return f, int(f.Fd()), nil
}

// stdinGuard guards against reading two different things from one stdin.
type stdinGuard struct{ used string }

func (g *stdinGuard) claim(what string) error {
	if g.used != "" {
		return usagef("both %s and %s want standard input ('-'): only one can have it", g.used, what)
	}
	g.used = what
	return nil
}

// read loads the credentials cf names. prompt is the terminal prompt used when no
// passphrase file is given and a passphrase is wanted; confirm asks twice (for a new key).
func (cf credFlags) read(stdin *stdinGuard, prompt string, confirm bool) (*credentials, error) {
	c := &credentials{}
	ok := false
	defer func() {
		if !ok {
			c.wipe()
		}
	}()
	for _, path := range cf.keyfiles {
		data, err := readKeyfile(stdin, path)
		if err != nil {
			return nil, err
		}
		c.keyfiles = append(c.keyfiles, data)
	}
	switch {
	case cf.noPassphrase && cf.passphraseFile != "":
		return nil, usagef("--no-passphrase and a passphrase file exclude each other")
	case cf.noPassphrase:
		if len(c.keyfiles) == 0 {
			return nil, usagef("--no-passphrase needs at least one --keyfile")
		}
	case cf.passphraseFile != "":
		p, err := readPassphraseFile(stdin, cf.passphraseFile)
		if err != nil {
			return nil, err
		}
		c.passphrase = p
	default:
		p, err := promptPassphrase(prompt, confirm, len(c.keyfiles) > 0)
		if err != nil {
			return nil, err
		}
		c.passphrase = p
	}
	if c.passphrase != nil && len(c.passphrase) == 0 && len(c.keyfiles) == 0 {
		return nil, errEmptyPassphrase
	}
	ok = true
	return c, nil
}

func openCredential(stdin *stdinGuard, path, what string) (io.ReadCloser, error) {
	if path == "-" {
		if err := stdin.claim(what); err != nil {
			return nil, err
		}
		return io.NopCloser(os.Stdin), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return f, nil
}

// readPassphraseFile returns the first line of the file, without its line ending.
func readPassphraseFile(stdin *stdinGuard, path string) ([]byte, error) {
	r, err := openCredential(stdin, path, "passphrase file")
	if err != nil {
		return nil, err
	}
	defer r.Close()
	br := bufio.NewReaderSize(io.LimitReader(r, maxPassphrase+2), maxPassphrase+2)
	line, err := br.ReadSlice('\n')
	if err != nil && err != io.EOF {
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, fmt.Errorf("passphrase in %s is longer than %d bytes", path, maxPassphrase)
		}
		return nil, fmt.Errorf("read passphrase file %s: %w", path, err)
	}
	line = bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r"))
	if len(line) > maxPassphrase {
		return nil, fmt.Errorf("passphrase in %s is longer than %d bytes", path, maxPassphrase)
	}
	out := append([]byte{}, line...)
	clear(line)
	return out, nil
}

func readKeyfile(stdin *stdinGuard, path string) ([]byte, error) {
	r, err := openCredential(stdin, path, "keyfile "+path)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	data, err := io.ReadAll(io.LimitReader(r, maxKeyfile+1))
	if err != nil {
		return nil, fmt.Errorf("read keyfile %s: %w", path, err)
	}
	if len(data) > maxKeyfile {
		clear(data)
		return nil, fmt.Errorf("keyfile %s is larger than %d MiB", path, maxKeyfile>>20)
	}
	if len(data) == 0 {
		return nil, fmt.Errorf("keyfile %s is empty", path)
	}
	return data, nil
}

var errEmptyPassphrase = errors.New("empty passphrase: give one, or use --keyfile with --no-passphrase")

// promptPassphrase asks on the terminal, twice if confirm. An empty answer is refused at
// once unless allowEmpty (keyfiles were given: an empty passphrase then means none).
func promptPassphrase(prompt string, confirm, allowEmpty bool) ([]byte, error) {
	tty, fd, err := openTerminal()
	if err != nil {
		return nil, errors.New("no terminal to ask for the passphrase: give --passphrase-file FILE (or - for standard input)")
	}
	defer tty.Close()
	p1, err := readNoEcho(tty, fd, prompt+": ")
	if err != nil {
		return nil, err
	}
	if len(p1) == 0 && !allowEmpty {
		return nil, errEmptyPassphrase
	}
	if !confirm {
		return p1, nil
	}
	p2, err := readNoEcho(tty, fd, "Reenter "+lowerFirst(strings.TrimPrefix(prompt, "Enter "))+": ")
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
	line := make([]byte, 0, maxPassphrase) // never reallocated: no stray copies
	var b [1]byte
	for {
		n, err := tty.Read(b[:])
		if n == 1 {
			if b[0] == '\n' {
				return line, nil
			}
			if len(line) == maxPassphrase {
				clear(line)
				return nil, fmt.Errorf("passphrase longer than %d bytes", maxPassphrase)
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

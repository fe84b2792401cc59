// Package keysource is where the secrets that unlock a volume come from: a terminal
// prompt, a passphrase file, keyfiles, a systemd credential, a key command, or systemd's
// password agent. Each is a Source; the CLI turns its flags into Sources and hands what
// they give to keys, so that no command has a branch of its own per source.
//
// Every source is bounded: in size (a keyfile of /dev/zero is an error, not an
// out-of-memory kill) and, where it waits on something outside eli (a command, a person
// answering the agent), in time. What a source returns is the caller's to wipe.
package keysource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
)

// Bounds on what eli reads as a secret.
const (
	MaxPassphrase = 4096
	MaxKeyfile    = 64 << 20
	// MaxKey bounds a credential and a key command's output: systemd's own limit on a
	// credential (CREDENTIAL_SIZE_MAX) is 1 MiB.
	MaxKey = 1 << 20
)

// Kind is how keys uses what a Source gives.
type Kind int

const (
	// AsPassphrase: one line of text, stretched by Argon2id with the keyfiles.
	AsPassphrase Kind = iota
	// AsKeyfile: bytes taken whole, as a keyfile is.
	AsKeyfile
)

// A Source yields one secret.
type Source interface {
	Kind() Kind
	// Read returns the secret, which the caller wipes. It fails rather than waits
	// forever, and its error says which source failed and what to do.
	Read(ctx context.Context) ([]byte, error)
	// String names the source for messages; it never holds the secret.
	String() string
}

// ErrEmptyPassphrase is a passphrase of zero bytes where one is needed.
var ErrEmptyPassphrase = errors.New("empty passphrase: give one, or use --keyfile with --no-passphrase")

// Stdin hands standard input ('-') to one source at most: two secrets cannot both be
// read from it.
type Stdin struct{ used string }

// Claim takes standard input for what, or fails if another source has it.
func (s *Stdin) Claim(what string) error {
	if s.used != "" {
		return fmt.Errorf("both %s and %s want standard input ('-'): only one can have it", s.used, what)
	}
	s.used = what
	return nil
}

// open opens path, or standard input for "-".
func open(stdin *Stdin, path, what string) (io.ReadCloser, error) {
	if path == "-" {
		if stdin == nil {
			stdin = &Stdin{}
		}
		if err := stdin.Claim(what); err != nil {
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

// readAll reads all of r, failing past limit bytes; what names the source for errors.
// Nothing it read survives an error.
func readAll(r io.Reader, limit int, what string) ([]byte, error) {
	// One buffer, never grown by append: no stray copies of the secret in freed memory.
	buf := make([]byte, 0, min(limit+1, 64<<10))
	for {
		if len(buf) == cap(buf) {
			if len(buf) > limit {
				clear(buf)
				return nil, fmt.Errorf("%s is larger than %s", what, sizeText(limit))
			}
			bigger := make([]byte, len(buf), min(2*cap(buf), limit+1))
			copy(bigger, buf)
			clear(buf)
			buf = bigger
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if len(buf) > limit {
			clear(buf)
			return nil, fmt.Errorf("%s is larger than %s", what, sizeText(limit))
		}
		if errors.Is(err, io.EOF) {
			return buf, nil
		}
		if err != nil {
			clear(buf)
			return nil, fmt.Errorf("read %s: %w", what, err)
		}
	}
}

func sizeText(n int) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d bytes", n)
}

// Keyfile reads a file (or standard input, "-") whole, as a key.
type Keyfile struct {
	Path  string
	Stdin *Stdin
}

func (k Keyfile) Kind() Kind     { return AsKeyfile }
func (k Keyfile) String() string { return "keyfile " + k.Path }

func (k Keyfile) Read(context.Context) ([]byte, error) {
	r, err := open(k.Stdin, k.Path, k.String())
	if err != nil {
		return nil, err
	}
	defer r.Close()
	data, err := readAll(r, MaxKeyfile, k.String())
	if err != nil {
		return nil, err
	}
	if len(data) == 0 {
		return nil, fmt.Errorf("%s is empty", k)
	}
	return data, nil
}

// PassphraseFile reads the first line of a file (or of standard input, "-"), without
// its line ending, as a passphrase.
type PassphraseFile struct {
	Path  string
	Stdin *Stdin
}

func (p PassphraseFile) Kind() Kind     { return AsPassphrase }
func (p PassphraseFile) String() string { return "passphrase file " + p.Path }

func (p PassphraseFile) Read(context.Context) ([]byte, error) {
	r, err := open(p.Stdin, p.Path, "passphrase file")
	if err != nil {
		return nil, err
	}
	defer r.Close()
	// Read one byte at a time, as a terminal is: only the first line leaves the file,
	// so that standard input keeps what follows it.
	line := make([]byte, 0, MaxPassphrase+1)
	var b [1]byte
	for {
		n, err := r.Read(b[:])
		if n == 1 {
			if b[0] == '\n' {
				break
			}
			if len(line) == MaxPassphrase+1 {
				clear(line)
				return nil, fmt.Errorf("passphrase in %s is longer than %d bytes", p.Path, MaxPassphrase)
			}
			line = append(line, b[0])
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			clear(line)
			return nil, fmt.Errorf("read passphrase file %s: %w", p.Path, err)
		}
	}
	if len(line) > 0 && line[len(line)-1] == '\r' {
		line[len(line)-1] = 0
		line = line[:len(line)-1]
	}
	if len(line) > MaxPassphrase {
		clear(line)
		return nil, fmt.Errorf("passphrase in %s is longer than %d bytes", p.Path, MaxPassphrase)
	}
	return line, nil
}

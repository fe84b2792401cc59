package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

// target is one server configuration to measure.
type target struct {
	Name  string `json:"name"`  // as --targets spells it
	Label string `json:"label"` // for tables and the chart
	kind  targetKind
	mode  sector.Mode // eli targets
}

type targetKind int

const (
	kindNbdkitFile targetKind = iota
	kindQemuLUKS
	kindNbdkitLUKS
	kindEli
)

// Names of the targets the ratios and checks refer to.
const (
	nameQemuLUKS   = "qemu-nbd-luks"
	nameNbdkitLUKS = "nbdkit-luks"
	nameEliNone    = "eli-none"
	nameEliAEAD    = "eli-xchacha20-poly1305"
)

func allTargets() []target {
	ts := []target{
		{Name: "nbdkit-file", Label: "nbdkit file (plaintext)", kind: kindNbdkitFile},
		{Name: nameQemuLUKS, Label: "qemu-nbd + LUKS aes-xts", kind: kindQemuLUKS},
		{Name: nameNbdkitLUKS, Label: "nbdkit luks filter (aes-xts)", kind: kindNbdkitLUKS},
	}
	for _, m := range []sector.Mode{sector.ModeNone, sector.ModeXChaCha20Poly1305, sector.ModeChaCha20XTS,
		sector.ModeChaCha8XTS, sector.ModeAESXTS256} {
		label := "eli " + m.String()
		if m.Unsafe() {
			label += " (UNSAFE)"
		}
		ts = append(ts, target{Name: "eli-" + m.String(), Label: label, kind: kindEli, mode: m})
	}
	return ts
}

func allTargetNames() []string {
	var names []string
	for _, t := range allTargets() {
		names = append(names, t.Name)
	}
	return names
}

// parseTargets picks targets by name, in the canonical order.
func parseTargets(list string) ([]string, error) {
	want := map[string]bool{}
	for _, n := range strings.Split(list, ",") {
		if n = strings.TrimSpace(n); n != "" {
			want[n] = true
		}
	}
	var names []string
	for _, t := range allTargets() {
		if want[t.Name] {
			names = append(names, t.Name)
			delete(want, t.Name)
		}
	}
	for n := range want {
		return nil, fmt.Errorf("--targets: unknown server %q (known: %s)", n, strings.Join(allTargetNames(), ","))
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("--targets: name at least one server")
	}
	return names, nil
}

func targetByName(name string) target {
	for _, t := range allTargets() {
		if t.Name == name {
			return t
		}
	}
	panic("unknown target " + name)
}

// world is what every server setup shares: the working directory and the tools.
type world struct {
	dir      string // on tmpfs
	size     int64  // bytes each export holds
	eli      string // binary
	passFile string // passphrase for LUKS and eli (the benchmark's, not a secret)
	logDir   string
}

// server is a running target.
type server struct {
	t    target
	argv []string // what started it, to start it again (restart)
	sock string
	cmd  *exec.Cmd
	uri  string
	size int64 // the export's size, as the server reports it
	log  *os.File
	done chan struct{}
	err  error // the process's exit, once done is closed
}

// luksPayload is where cryptsetup's LUKS1 puts the data with a 512-bit key: 4096 sectors
// (cryptsetup's 1 MiB alignment after a header of about 1 MiB).
const luksPayload = 2 << 20

// start prepares t's backing file and starts its server.
func (w *world) start(ctx context.Context, t target) (*server, error) {
	sock := filepath.Join(w.dir, t.Name+".sock")
	img := filepath.Join(w.dir, t.Name+".img")
	var argv []string
	switch t.kind {
	case kindNbdkitFile:
		if err := preallocate(img, w.size); err != nil {
			return nil, err
		}
		argv = []string{"nbdkit", "-f", "-U", sock, "file", "file=" + img}
	case kindQemuLUKS, kindNbdkitLUKS:
		if err := w.makeLUKS(ctx, img); err != nil {
			return nil, err
		}
		if t.kind == kindQemuLUKS {
			// -t: keep serving after the first client leaves; -e: let nbdcopy's
			// connections in at once (qemu-nbd then advertises multi-conn).
			argv = []string{"qemu-nbd", "-t", "-e", "16", "-k", sock, "--cache=writeback", "--aio=threads",
				"--object", "secret,id=sec0,file=" + w.passFile,
				"--image-opts", "driver=luks,key-secret=sec0,file.driver=file,file.filename=" + img}
		} else {
			argv = []string{"nbdkit", "-f", "-U", sock, "--filter=luks", "file", "file=" + img, "passphrase=+" + w.passFile}
		}
	case kindEli:
		if err := w.makeEli(ctx, t.mode, img); err != nil {
			return nil, err
		}
		argv = []string{w.eli, "--state-dir", filepath.Join(w.dir, "state"), "attach", "--foreground",
			"--passphrase-file", w.passFile, "--name", t.Name, "--socket", sock, img}
	}
	return w.spawn(ctx, t, argv, sock)
}

// restart stops s and starts its server again on the same backing file: a fresh
// process, which has read nothing and touched no memory of its own yet.
func (w *world) restart(ctx context.Context, s *server) (*server, error) {
	if err := s.stop(); err != nil {
		return nil, err
	}
	// Not every server removes its socket when it stops, and nbdkit refuses one that is
	// there.
	if err := os.Remove(s.sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	return w.spawn(ctx, s.t, s.argv, s.sock)
}

// spawn starts argv as t's server and waits until its export answers.
func (w *world) spawn(ctx context.Context, t target, argv []string, sock string) (*server, error) {
	// Appended to: a restarted server's log follows its predecessor's.
	logf, err := os.OpenFile(filepath.Join(w.logDir, t.Name+".log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	s := &server{t: t, argv: argv, sock: sock, log: logf, done: make(chan struct{}), uri: "nbd+unix:///?socket=" + sock}
	s.cmd = exec.Command(argv[0], argv[1:]...)
	s.cmd.Stderr = logf
	stdout := &outBuffer{log: logf}
	s.cmd.Stdout = stdout
	// Its own process group, so that a ^C reaches the bench, which then stops it in order.
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := s.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", t.Name, err)
	}
	go func() {
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := exec.CommandContext(ctx, "nbdinfo", "--size", s.uri).Output()
		if err == nil {
			if _, err := fmt.Sscan(string(out), &s.size); err != nil {
				s.stop()
				return nil, fmt.Errorf("%s: nbdinfo --size said %q", t.Name, out)
			}
			break
		}
		select {
		case <-s.done:
			logf.Close()
			return nil, fmt.Errorf("%s exited before serving (%v); log: %s", t.Name, s.err, logf.Name())
		case <-ctx.Done():
			s.stop()
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("%s does not answer on %s after 60s; log: %s", t.Name, sock, logf.Name())
		}
	}
	if s.size < w.size {
		s.stop()
		return nil, fmt.Errorf("%s exports %d bytes, fewer than --size %d", t.Name, s.size, w.size)
	}
	if t.kind == kindEli {
		// attach prints the URI last; it must be the socket we asked for.
		if !strings.Contains(stdout.String(), sock) {
			s.stop()
			return nil, fmt.Errorf("%s: attach printed %q, not the socket %s", t.Name, stdout.String(), sock)
		}
	}
	return s, nil
}

// stop ends the server (SIGTERM: eli commits and detaches cleanly) and waits for it.
func (s *server) stop() error {
	defer s.log.Close()
	select {
	case <-s.done:
		return nil
	default:
	}
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(60 * time.Second):
		s.cmd.Process.Kill()
		<-s.done
		return fmt.Errorf("%s did not stop within 60s of SIGTERM; killed", s.t.Name)
	}
	var ee *exec.ExitError
	if s.err != nil && !(errors.As(s.err, &ee) && ee.Sys().(syscall.WaitStatus).Signaled()) {
		return fmt.Errorf("%s: %w (log: %s)", s.t.Name, s.err, s.log.Name())
	}
	return nil
}

// cpuTime is the CPU time (user + system, every thread) the server has used so far.
func (s *server) cpuTime() (time.Duration, error) {
	return procCPUTime(s.cmd.Process.Pid)
}

func procCPUTime(pid int) (time.Duration, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("server CPU time: %w", err)
	}
	// The fields after the parenthesised command name; utime and stime are the 14th and
	// 15th of the whole line (proc(5)).
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 || i+2 > len(raw) {
		return 0, fmt.Errorf("server CPU time: /proc/%d/stat is malformed", pid)
	}
	f := strings.Fields(string(raw[i+2:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("server CPU time: /proc/%d/stat has %d fields", pid, len(f))
	}
	var ut, st int64
	if _, err := fmt.Sscan(f[11], &ut); err != nil {
		return 0, fmt.Errorf("server CPU time: utime %q: %w", f[11], err)
	}
	if _, err := fmt.Sscan(f[12], &st); err != nil {
		return 0, fmt.Errorf("server CPU time: stime %q: %w", f[12], err)
	}
	const ticksPerSecond = 100 // USER_HZ, which /proc always uses on Linux
	return time.Duration(ut+st) * time.Second / ticksPerSecond, nil
}

// makeLUKS formats a LUKS1 image whose payload is exactly size bytes. qemu-nbd 7.x and
// nbdkit's luks filter read LUKS1 only (qemu refuses "LUKS version 2 is not supported";
// nbdkit-luks-filter(1): "Note you must force LUKSv1"); the data path, aes-xts-plain64 on
// 512-byte sectors, is LUKS2's default too. The key derivation is cheapened, which only
// affects the time to open the image.
func (w *world) makeLUKS(ctx context.Context, img string) error {
	if err := preallocate(img, w.size+luksPayload); err != nil {
		return err
	}
	return runTool(ctx, "cryptsetup", "luksFormat", "-q", "--type", "luks1", "--cipher", "aes-xts-plain64",
		"--key-size", "512", "--hash", "sha256", "--pbkdf-force-iterations", "1000", "--align-payload", "4096",
		"--key-file", w.passFile, img)
}

// makeEli initialises an eli volume of mode m whose export holds at least size bytes,
// on a preallocated file.
func (w *world) makeEli(ctx context.Context, m sector.Mode, img string) error {
	p, err := eliProviderSize(w.size, m)
	if err != nil {
		return err
	}
	if err := preallocate(img, p); err != nil {
		return err
	}
	args := []string{"init", "--cipher", m.String(), "--passphrase-file", w.passFile,
		"--kdf-time", "1", "--kdf-memory", "8", "--kdf-threads", "1"}
	if m.Unsafe() || m == sector.ModeNone { // init asks --unsafe for none too
		args = append(args, "--unsafe")
	}
	return runTool(ctx, w.eli, append(args, img)...)
}

// eliProviderSize is the smallest provider (a multiple of 64 KiB) whose eli volume of
// mode m, in 4096-byte sectors and the format version eli init makes, exports at least
// size bytes.
func eliProviderSize(size int64, m sector.Mode) (int64, error) {
	const unit = 64 << 10
	fits := func(p int64) bool {
		l, err := layout.PlanVersion(layout.DefaultVersion(m), p, 4096, m, 0)
		return err == nil && l.Size() >= size
	}
	lo, hi := size/unit, 2*size/unit+1024 // every mode's overhead is far below size + 64 MiB
	if !fits(hi * unit) {
		return 0, fmt.Errorf("no provider size up to %d bytes holds a %d-byte %s volume", hi*unit, size, m)
	}
	for lo < hi {
		mid := (lo + hi) / 2
		if fits(mid * unit) {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return lo * unit, nil
}

// preallocate creates path with size bytes allocated, so that no measured write waits
// for tmpfs to find a page.
func preallocate(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if err := syscall.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		f.Close()
		return fmt.Errorf("preallocate %s: %w", path, err)
	}
	return f.Close()
}

// runTool runs a setup command and returns its output with the error.
func runTool(ctx context.Context, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return nil
}

// outBuffer keeps what a server prints on stdout (attach's URI) and copies it to its log;
// the exec package writes it from its own goroutine while spawn reads it.
type outBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
	log *os.File
}

func (b *outBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	return b.log.Write(p)
}

func (b *outBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

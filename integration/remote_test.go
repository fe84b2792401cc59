package integration

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/nbdclient"
)

// Issue 15: remote NBD exports as providers. A storage server (nbdkit's file plugin or
// qemu-nbd) serves a file in the test's directory over a unix socket; eli uses it
// through an nbd+unix:// or nbds+unix:// URI.

func init() {
	// Ownership heartbeats every 300 ms, so that a refused or forced second attach
	// waits about a second instead of six (eli's ownerIntervalEnv; tests only). Local
	// providers do not use the mark, so other tests do not notice.
	os.Setenv("ELI_TEST_OWNER_INTERVAL", "300ms")
}

// storage is one storage server process over a file, restartable on the same socket.
type storage struct {
	t     testing.TB
	name  string   // program
	args  []string // its arguments
	sock  string
	file  string
	uri   string // the URI eli is given
	mu    sync.Mutex
	cmd   *exec.Cmd
	exits chan error
	out   *bytes.Buffer // what the server said
}

// tlsDirs makes a CA, a server certificate for "localhost" (nbdkit's layout in srv) and
// a client directory holding only the CA certificate (libnbd's tls-certificates layout).
func tlsDirs(t testing.TB, dir string) (srv, cli string) {
	t.Helper()
	openssl := testtool.Need(t, "openssl", "openssl")
	srv, cli = filepath.Join(dir, "srv"), filepath.Join(dir, "cli")
	for _, d := range []string{srv, cli} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	ext := filepath.Join(dir, "ext.cnf")
	if err := os.WriteFile(ext, []byte("subjectAltName=DNS:localhost\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ec := []string{"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"}
	run := func(args ...string) { command(t, time.Minute, openssl, args...) }
	run(append(append([]string{"req", "-x509"}, ec...), "-keyout", filepath.Join(dir, "ca-key.pem"),
		"-out", filepath.Join(srv, "ca-cert.pem"), "-days", "2", "-subj", "/CN=eli test CA")...)
	run(append(append([]string{"req"}, ec...), "-keyout", filepath.Join(srv, "server-key.pem"),
		"-out", filepath.Join(dir, "server.csr"), "-subj", "/CN=localhost")...)
	run("x509", "-req", "-in", filepath.Join(dir, "server.csr"), "-CA", filepath.Join(srv, "ca-cert.pem"),
		"-CAkey", filepath.Join(dir, "ca-key.pem"), "-CAcreateserial", "-out", filepath.Join(srv, "server-cert.pem"),
		"-days", "2", "-extfile", ext)
	ca, err := os.ReadFile(filepath.Join(srv, "ca-cert.pem"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cli, "ca-cert.pem"), ca, 0o600); err != nil {
		t.Fatal(err)
	}
	return srv, cli
}

// newStorage serves a new file of size bytes in e's directory. kind is "nbdkit",
// "nbdkit-tls" or "qemu-nbd"; extra goes to nbdkit before the plugin (filters) and
// params after it.
func newStorage(e *env, kind string, size int64, filters, params []string) *storage {
	t := e.t
	t.Helper()
	// A test may run several (a remote provider and a reference): each its own file.
	s := &storage{t: t, file: e.Path("export.img")}
	for n := 2; ; n++ {
		if _, err := os.Stat(s.file); errors.Is(err, os.ErrNotExist) {
			break
		}
		s.file = e.Path(fmt.Sprintf("export-%d.img", n))
	}
	s.sock = filepath.Join(e.mkdirTemp("", "nbd"), "s")
	if err := os.WriteFile(s.file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(s.file, size); err != nil {
		t.Fatal(err)
	}
	s.uri = "nbd+unix:///?socket=" + s.sock
	switch kind {
	case "nbdkit", "nbdkit-tls":
		s.name = testtool.Need(t, "nbdkit", "nbdkit")
		s.args = []string{"-f", "--exit-with-parent", "-U", s.sock}
		if kind == "nbdkit-tls" {
			srv, cli := tlsDirs(t, e.mkdirTemp("", "tls"))
			s.args = append(s.args, "--tls=require", "--tls-certificates="+srv)
			s.uri = "nbds+unix:///?socket=" + s.sock + "&tls-certificates=" + cli
		}
		s.args = append(append(append(s.args, filters...), "file", "file="+s.file), params...)
	case "qemu-nbd":
		s.name = testtool.Need(t, "qemu-nbd", "qemu-utils")
		s.args = []string{"-f", "raw", "-k", s.sock, "-t", "-e", "8", "--cache=writeback", s.file}
	default:
		t.Fatalf("unknown storage %s", kind)
	}
	s.start()
	t.Cleanup(s.stop)
	return s
}

func (s *storage) start() {
	s.t.Helper()
	os.Remove(s.sock) // a killed server leaves its socket
	cmd := exec.Command(s.name, s.args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	exits := make(chan error, 1)
	go func() { exits <- cmd.Wait() }()
	s.mu.Lock()
	s.cmd, s.exits, s.out = cmd, exits, &out
	s.mu.Unlock()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if c, err := net.Dial("unix", s.sock); err == nil {
			c.Close()
			return
		}
		select {
		case err := <-exits:
			s.t.Fatalf("%s exited at start: %v\n%s", s.name, err, out.String())
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s did not listen on %s within 30 s", s.name, s.sock)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill9 kills the server with SIGKILL and waits for it to be gone.
func (s *storage) kill9() {
	s.mu.Lock()
	cmd, exits := s.cmd, s.exits
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(syscall.SIGKILL)
	<-exits
}

func (s *storage) stop() { s.kill9() }

// exited says why the server exited if it did (it should not by itself), or "".
func (s *storage) exited() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case err := <-s.exits:
		s.exits <- err
		return fmt.Sprintf("%s exited: %v\n%s", s.name, err, s.out.String())
	default:
		return ""
	}
}

// remoteInit is eli init on a remote URI (no --size: the export's size).
func (e *env) remoteInit(uri string, extra ...string) {
	e.t.Helper()
	e.OK(append(append(append([]string{"init", "--passphrase-file", e.Pass}, elitest.QuickKDF...), extra...), uri)...)
}

// markState is the state word of the ownership block in the storage file (0 empty,
// 1 held, 2 released).
func markState(t testing.TB, file string) uint32 {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [4]byte
	if _, err := f.ReadAt(b[:], 4096+8); err != nil {
		t.Fatal(err)
	}
	return binary.LittleEndian.Uint32(b[:])
}

// TestRemoteRoundTrip: init, attach, write, detach, re-attach and read over nbd+unix
// (nbdkit and qemu-nbd) and nbds+unix (nbdkit requiring TLS, certificates made by
// openssl); the storage file never holds the plaintext.
func TestRemoteRoundTrip(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"nbdkit", "qemu-nbd", "nbdkit-tls"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, true)
			st := newStorage(e, kind, 32<<20, nil, nil)

			e.Fails("larger than the export", append(append([]string{"init", "--size", "64M", "--passphrase-file", e.Pass}, elitest.QuickKDF...), st.uri)...)
			e.remoteInit(st.uri)
			if out := e.OK("dump", st.uri).Stdout; !strings.Contains(out, "volume id") {
				t.Fatalf("dump of %s:\n%s", st.uri, out)
			}

			// Plaintext with a marker that must never reach the storage side.
			marker := []byte("ELI-REMOTE-PLAINTEXT-MARKER-0123456789")
			src := e.Path("plain")
			plain := bytes.Repeat(marker, (4<<20)/len(marker))
			if err := os.WriteFile(src, plain, 0o600); err != nil {
				t.Fatal(err)
			}
			uri := e.Attach(st.uri, "--name", "r")
			rec := e.Attached("r")
			if !strings.HasPrefix(rec.Provider, strings.SplitN(st.uri, ":", 2)[0]+":") || strings.Contains(rec.Provider, "\n") {
				t.Fatalf("list shows the provider as %q, want the URI %s", rec.Provider, st.uri)
			}
			if got := markState(t, st.file); got != 1 {
				t.Fatalf("ownership mark while attached: state %d, want 1 (held)", got)
			}
			nbdcopyIn(t, src, uri)
			want, n := exportHash(t, uri)
			e.detach("r")
			if got := markState(t, st.file); got != 2 {
				t.Fatalf("ownership mark after detach: state %d, want 2 (released)", got)
			}
			stored, err := os.ReadFile(st.file)
			if err != nil {
				t.Fatal(err)
			}
			if bytes.Contains(stored, marker) {
				t.Fatal("the storage file holds the plaintext")
			}

			uri = e.Attach(st.uri, "--name", "r")
			got, m := exportHash(t, uri)
			if got != want || m != n {
				t.Fatalf("after re-attach the export reads %x (%d bytes), want %x (%d)", got, m, want, n)
			}
			head := make([]byte, len(plain))
			c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
			if err != nil {
				t.Fatal(err)
			}
			if err := c.ReadAt(head, 0); err != nil {
				t.Fatal(err)
			}
			c.Close()
			if !bytes.Equal(head, plain) {
				t.Fatal("the plaintext read back differs from what was written")
			}
			e.detach("r")
		})
	}
}

// TestRemoteStorageKill9: the storage server is SIGKILLed and restarted, three times,
// while a client writes and flushes through eli's export. eli's export stays up, every
// request succeeds (the remote client reconnects and replays), and afterwards, also
// after a detach and re-attach, every block holds the last data written to it: 0 lost
// flushed writes, 0 wrong data.
func TestRemoteStorageKill9(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	st := newStorage(e, "nbdkit", 32<<20, nil, nil)
	e.remoteInit(st.uri)
	uri := e.Attach(st.uri, "--name", "k")

	const block, nblocks = 64 << 10, 128
	cur := make([][]byte, nblocks) // last data written to each block (nil: never)
	var (
		mu       sync.Mutex
		writes   int
		flushes  int
		errs     []string
		stopping = make(chan struct{})
		done     = make(chan struct{})
	)
	c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go func() {
		defer close(done)
		rng := rand.New(rand.NewPCG(15, 9))
		for i := 0; ; i++ {
			select {
			case <-stopping:
				return
			default:
			}
			k := rng.IntN(nblocks)
			p := make([]byte, block)
			fillRandom(rng, p)
			if err := c.WriteAt(p, int64(k)*block, false); err != nil {
				mu.Lock()
				errs = append(errs, fmt.Sprintf("write %d: %v", i, err))
				mu.Unlock()
				return
			}
			mu.Lock()
			cur[k], writes = p, writes+1
			mu.Unlock()
			if i%8 == 7 {
				if err := c.Flush(); err != nil {
					mu.Lock()
					errs = append(errs, fmt.Sprintf("flush after write %d: %v", i, err))
					mu.Unlock()
					return
				}
				mu.Lock()
				flushes++
				mu.Unlock()
			}
		}
	}()
	for round := 0; round < 3; round++ {
		time.Sleep(400 * time.Millisecond)
		mu.Lock()
		before := writes
		mu.Unlock()
		st.kill9()
		time.Sleep(300 * time.Millisecond)
		st.start()
		t.Logf("round %d: storage killed after %d writes, restarted", round, before)
	}
	time.Sleep(500 * time.Millisecond)
	close(stopping)
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the writer is stuck") // a hang guard
	}
	if len(errs) > 0 {
		t.Fatalf("requests failed across storage restarts: %v\nserver log:\n%s", errs, e.serverLog("k"))
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d writes, %d flushes across 3 storage restarts", writes, flushes)
	if !strings.Contains(e.serverLog("k"), "reconnected") {
		t.Fatalf("the server log does not show a reconnection:\n%s", e.serverLog("k"))
	}
	check := func(c *nbdclient.Client, when string) {
		got := make([]byte, block)
		for k, want := range cur {
			if want == nil {
				want = make([]byte, block)
			}
			if err := c.ReadAt(got, int64(k)*block); err != nil {
				t.Fatalf("%s: read block %d: %v", when, k, err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("%s: block %d holds other data than was last written and flushed", when, k)
			}
		}
	}
	check(c, "while attached")
	c.Close()
	e.detach("k")
	uri = e.Attach(st.uri, "--name", "k")
	c2, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	check(c2, "after re-attach")
	c2.Close()
	e.detach("k")
}

// TestRemoteFaultFilters: nbdkit's delay filter slows every request and its error
// filter fails a share of the storage's reads, then writes: eli's export answers the
// affected requests with errors, returns only correct data, and keeps serving.
func TestRemoteFaultFilters(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	readErrs, writeErrs := e.Path("read-errors"), e.Path("write-errors")
	st := newStorage(e, "nbdkit", 16<<20, []string{"--filter=error", "--filter=delay"},
		[]string{"delay-read=1ms", "delay-write=2ms", "error=EIO",
			"error-pread-rate=30%", "error-pread-file=" + readErrs,
			"error-pwrite-rate=30%", "error-pwrite-file=" + writeErrs})
	e.remoteInit(st.uri)
	uri := e.Attach(st.uri, "--name", "f")
	c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const block, nblocks = 16 << 10, 64
	data := make([]byte, block*nblocks)
	fillRandom(rand.New(rand.NewPCG(1, 2)), data)
	if err := c.WriteAt(data, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	// Reads: some fail, none returns wrong data. eli's cache may hold recently read
	// metadata, so read each block more than once.
	if err := os.WriteFile(readErrs, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	failed, ok := 0, 0
	got := make([]byte, block)
	for pass := 0; pass < 3; pass++ {
		for k := 0; k < nblocks; k++ {
			if err := c.ReadAt(got, int64(k)*block); err != nil {
				failed++
				continue
			}
			ok++
			if !bytes.Equal(got, data[k*block:(k+1)*block]) {
				t.Fatalf("block %d read wrong data while the storage failed reads", k)
			}
		}
	}
	if failed == 0 || ok == 0 {
		t.Fatalf("%d reads failed and %d succeeded with 30%% of the storage's reads failing: want some of each", failed, ok)
	}
	os.Remove(readErrs)
	for k := 0; k < nblocks; k++ {
		if err := c.ReadAt(got, int64(k)*block); err != nil {
			t.Fatalf("block %d after the read errors stopped: %v", k, err)
		}
		if !bytes.Equal(got, data[k*block:(k+1)*block]) {
			t.Fatalf("block %d after the read errors stopped: wrong data", k)
		}
	}
	t.Logf("reads with errors injected: %d failed, %d correct", failed, ok)

	// Writes: a failing storage write fails eli's request (and, in an authenticated
	// mode, stops the volume's writes); the server stays up and still serves reads.
	if err := os.WriteFile(writeErrs, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	werr := 0
	for i := 0; i < 32 && werr == 0; i++ {
		if err := c.WriteAt(data[:block], int64(i%nblocks)*block, false); err != nil {
			werr++
		} else if err := c.Flush(); err != nil {
			werr++
		}
	}
	os.Remove(writeErrs)
	if werr == 0 {
		t.Fatal("no write or flush failed with 30% of the storage's writes failing")
	}
	if err := c.ReadAt(got, block); err != nil {
		t.Fatalf("read after a failed write: %v", err)
	}
	if !bytes.Equal(got, data[:block]) && !bytes.Equal(got, data[block:2*block]) {
		t.Fatal("read after a failed write: wrong data")
	}
	if st := e.Run("", "status", "f"); st.Code != 1 || !strings.Contains(st.Stdout, "failed") {
		t.Fatalf("status after a failed write: want the failed state and exit 1: %v", st)
	}
	c.Close()
	e.Run("", "detach", "f") // the final commit fails: the volume's writes stopped
	if strings.Contains(e.serverLog("f"), "panic") {
		t.Fatalf("the server panicked:\n%s", e.serverLog("f"))
	}
}

// TestRemoteSecondAttach: a volume attached read-write from one eli instance is refused
// to another (a different state directory stands in for another host), naming the
// holder; --force takes it over, and the first server stops accepting writes.
func TestRemoteSecondAttach(t *testing.T) {
	t.Parallel()
	a := newEnv(t, true)
	st := newStorage(a, "nbdkit", 16<<20, nil, nil)
	a.remoteInit(st.uri)
	uriA := a.Attach(st.uri, "--name", "a")

	b := newEnv(t, false)
	b.Pass = a.Pass
	r := b.Run("", "attach", "--passphrase-file", b.Pass, "--name", "b", st.uri)
	if r.Code == 0 || !strings.Contains(r.Stderr, "attached read-write by host") || !strings.Contains(r.Stderr, "--force") {
		t.Fatalf("second attach of a live remote volume: %v", r)
	}
	// Every command that writes the volume is refused the same way.
	r = b.Run("", "kill", "--yes", st.uri)
	if r.Code == 0 || !strings.Contains(r.Stderr, "attached read-write by host") {
		t.Fatalf("kill of a remote volume attached elsewhere: %v", r)
	}

	cA, err := nbdclient.Dial("unix", elitest.SocketOf(uriA), "")
	if err != nil {
		t.Fatal(err)
	}
	defer cA.Close()
	p := bytes.Repeat([]byte{7}, 4096)
	if err := cA.WriteAt(p, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := cA.Flush(); err != nil {
		t.Fatal(err)
	}

	uriB := b.Attach(st.uri, "--force", "--name", "b")
	// A's server finds the mark rewritten at its next heartbeat and fences itself: its
	// status turns failed without a write, and it refuses writes from then on.
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(a.Run("", "status", "a").Stdout, "failed") {
		if time.Now().After(deadline) {
			t.Fatalf("server a still serving 30 s after the takeover:\n%s", a.serverLog("a"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := cA.WriteAt(p, 4096, false); err == nil {
		t.Fatal("the taken-over server still accepts writes")
	}
	if err := cA.Flush(); err == nil {
		t.Fatal("the taken-over server still accepts flushes")
	}
	if log := a.serverLog("a"); !strings.Contains(log, "ownership lost") {
		t.Fatalf("server a's log does not say it lost the volume:\n%s", log)
	}
	cB, err := nbdclient.Dial("unix", elitest.SocketOf(uriB), "")
	if err != nil {
		t.Fatal(err)
	}
	defer cB.Close()
	got := make([]byte, 4096)
	if err := cB.ReadAt(got, 0); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("the new owner reads %v, %x..., want what the first wrote and flushed", err, got[:4])
	}
	if err := cB.WriteAt(p, 8192, false); err != nil {
		t.Fatal(err)
	}
	if err := cB.Flush(); err != nil {
		t.Fatal(err)
	}
	cA.Close()
	cB.Close()
	a.Run("", "detach", "a") // its final commit fails: it is fenced
	b.detach("b")
}

// TestRemoteAndLocalPathOfOneVolume: the ownership mark reaches every URI of an export,
// but not the export's own file attached on the same host as a local provider, which
// writes no mark. The volume ID lock refuses that second path either way round.
func TestRemoteAndLocalPathOfOneVolume(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	st := newStorage(e, "nbdkit", 16<<20, nil, nil)
	e.remoteInit(st.uri)
	const want = "already open for writing on this host"

	e.Attach(st.file, "--name", "local")
	e.Fails(want, "attach", "--passphrase-file", e.Pass, "--name", "remote", st.uri)
	e.Fails(want, "kill", "--yes", st.uri)
	e.detach("local")

	uri := e.Attach(st.uri, "--name", "remote")
	e.Fails(want, "attach", "--passphrase-file", e.Pass, "--name", "local", st.file)
	c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	p := bytes.Repeat([]byte{9}, 4096)
	if err := c.WriteAt(p, 0, true); err != nil {
		t.Fatalf("the remote attach after the refusal: %v", err)
	}
	c.Close()
	e.detach("remote")
}

// TestRemoteVerbs: the key and header verbs, resize and onetime take a remote PROVIDER.
func TestRemoteVerbs(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	st := newStorage(e, "nbdkit", 16<<20, nil, nil)
	e.remoteInit(st.uri)
	pass2 := e.Write("pass2", "another passphrase\n")
	backup := e.Path("hdr.backup")

	e.OK("backup", st.uri, backup)
	e.OK(append(append([]string{"setkey", "--passphrase-file", e.Pass, "--new-passphrase-file", pass2}, elitest.QuickKDF...), st.uri)...)
	if out := e.OK("dump", st.uri).Stdout; strings.Count(out, "argon2id") < 2 {
		t.Fatalf("dump after setkey shows fewer than two keyslots:\n%s", out)
	}
	uri := e.Attach(st.uri, "--name", "v", "--passphrase-file", pass2) // the new key opens it
	e.detach("v")
	e.OK("delkey", "--slot", "1", st.uri)
	if r := e.Run("", "attach", "--passphrase-file", pass2, "--name", "v", st.uri); r.Code == 0 {
		t.Fatalf("attach with a deleted key succeeded: %v", r)
	}

	// resize follows an export grown on the storage side; --size is refused.
	e.Fails("grow the export on the storage side", "resize", "--size", "64M", "--passphrase-file", e.Pass, st.uri)
	if err := os.Truncate(st.file, 32<<20); err != nil {
		t.Fatal(err)
	}
	if out := e.OK("resize", "--passphrase-file", e.Pass, st.uri).Stdout; !strings.Contains(out, "grown from") {
		t.Fatalf("resize of a grown export: %s", out)
	}
	uri = e.Attach(st.uri, "--name", "v")
	if info := nbdInfo(t, uri); info.Size < 24<<20 {
		t.Fatalf("after resize the volume is %d bytes, want the grown export's room", info.Size)
	}
	e.detach("v")

	e.OK("kill", "--yes", st.uri)
	if r := e.Run("", "attach", "--passphrase-file", e.Pass, "--name", "v", st.uri); r.Code == 0 {
		t.Fatalf("attach of a killed volume succeeded: %v", r)
	}
	e.OK("restore", "--force", backup, st.uri) // the backup was made before the resize
	uri = e.Attach(st.uri, "--name", "v")
	e.detach("v")

	// onetime destroys the volume only with --force, and serves a scratch volume.
	e.Fails("onetime would destroy it", "onetime", "--name", "s", st.uri)
	uri = e.serveURI(t, "onetime", "--force", "--name", "s", st.uri)
	if info := nbdInfo(t, uri); info.Size <= 0 {
		t.Fatalf("onetime volume of %d bytes", info.Size)
	}
	e.detach("s")
}

// serveURI runs an eli command that serves (onetime) and returns its export's URI.
func (e *env) serveURI(t *testing.T, args ...string) string {
	t.Helper()
	r := e.OK(args...)
	lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
	uri := lines[len(lines)-1]
	if !strings.HasPrefix(uri, elitest.URIPrefix) {
		t.Fatalf("last line of %s is not an NBD unix URI: %q", args[0], r.Stdout)
	}
	return uri
}

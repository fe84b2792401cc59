package nbd

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
	"github.com/elidisk/eli/internal/testtool"
)

// Tests against real NBD clients. Each says which tool it needs through testtool: it
// skips without it when run by hand, and fails under scripts/test (ELI_REQUIRE_TOOLS=1),
// which installs them all.

// run runs a client with a time bound and returns its combined output; failure fails the
// test with that output.
func run(t testing.TB, timeout time.Duration, name string, args ...string) string {
	t.Helper()
	out, err := runErr(timeout, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func runErr(timeout time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func uriFor(path, export string) string {
	return fmt.Sprintf("nbd+unix:///%s?socket=%s", export, path)
}

// countingHandler counts connection-opened log lines, to prove clients used several.
type countingHandler struct {
	slog.Handler
	opened *atomic.Int64
}

func (h countingHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "nbd: connection opened" {
		h.opened.Add(1)
	}
	return h.Handler.Handle(ctx, r)
}

func (h countingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return countingHandler{h.Handler.WithAttrs(as), h.opened}
}

func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestNbdinfo(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	srv := &Server{Exports: []Export{
		{Name: "", Description: "default disk", Backend: newMem(3 << 20), MultiConn: true, MinBlock: 512, PreferredBlock: 4096, MaxBlock: 1 << 20},
		{Name: "ro", Description: "read-only disk", Backend: newMem(1 << 20), ReadOnly: true},
	}}
	path := serveUnix(t, srv)

	parse := func(args ...string) testtool.NBDInfo {
		out := run(t, 30*time.Second, "nbdinfo", append([]string{"--json"}, args...)...)
		var i testtool.NBDInfo
		if err := json.Unmarshal([]byte(out), &i); err != nil {
			t.Fatalf("nbdinfo JSON: %v\n%s", err, out)
		}
		if i.Protocol != "newstyle-fixed" || !i.Structured || i.TLS {
			t.Errorf("protocol %q structured=%v TLS=%v", i.Protocol, i.Structured, i.TLS)
		}
		return i
	}

	i := parse(uriFor(path, ""))
	if len(i.Exports) != 1 {
		t.Fatalf("%d exports", len(i.Exports))
	}
	e := i.Exports[0]
	if e.Size != 3<<20 || e.ReadOnly || !e.CanFlush || !e.CanFUA || !e.CanTrim || !e.CanZero ||
		!e.CanFastZero || !e.CanMultiConn || !e.CanCache || !e.CanDF {
		t.Errorf("default export: %+v", e)
	}
	if e.MinBlock != 512 || e.PrefBlock != 4096 || e.MaxBlock != 1<<20 {
		t.Errorf("block sizes %d/%d/%d, want 512/4096/1048576", e.MinBlock, e.PrefBlock, e.MaxBlock)
	}
	if e.Description != "default disk" {
		t.Errorf("description %q", e.Description)
	}

	i = parse(uriFor(path, "ro"))
	e = i.Exports[0]
	if e.Size != 1<<20 || !e.ReadOnly || e.CanTrim || e.CanZero || e.CanFUA || !e.CanMultiConn {
		t.Errorf("read-only export: %+v", e)
	}

	i = parse("--list", uriFor(path, ""))
	var names []string
	for _, e := range i.Exports {
		names = append(names, e.Name+"="+e.Description)
	}
	if strings.Join(names, ",") != "=default disk,ro=read-only disk" {
		t.Errorf("--list: %q", names)
	}

	// The plain text form, as a person would run it.
	out := run(t, 30*time.Second, "nbdinfo", uriFor(path, ""))
	for _, want := range []string{"newstyle-fixed", "structured", "export-size: 3145728", "can_multi_conn: true", "block_size_minimum: 512"} {
		if !strings.Contains(out, want) {
			t.Errorf("nbdinfo output lacks %q:\n%s", want, out)
		}
	}
	if _, err := runErr(30*time.Second, "nbdinfo", uriFor(path, "nope")); err == nil {
		t.Error("nbdinfo succeeded on an unknown export")
	}
}

func TestNbdcopy(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	const size = 32 << 20
	mem := newMem(size)
	var opened atomic.Int64
	srv := &Server{
		Exports: []Export{{Backend: mem, MultiConn: true}},
		Logger:  slog.New(countingHandler{testLogger(t).Handler(), &opened}),
	}
	path := serveUnix(t, srv)
	dir := t.TempDir()
	src := filepath.Join(dir, "src.img")
	want := randomBytes(t, size)
	if err := os.WriteFile(src, want, 0o600); err != nil {
		t.Fatal(err)
	}

	run(t, 2*time.Minute, "nbdcopy", "--connections=4", "--threads=4", "--flush", src, uriFor(path, ""))
	mustEqual(t, "export after nbdcopy to NBD", mem.snapshot(), want)
	if n := opened.Load(); n < 4 {
		t.Errorf("nbdcopy opened %d connections, want 4", n)
	}
	if mem.flushes.Load() == 0 {
		t.Error("nbdcopy --flush did not reach the backend")
	}

	mem.fill(0x33)
	want = mem.snapshot()
	dst := filepath.Join(dir, "dst.img")
	run(t, 2*time.Minute, "nbdcopy", "--connections=4", "--threads=4", uriFor(path, ""), dst)
	got, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "file after nbdcopy from NBD", got, want)
	if n := opened.Load(); n < 8 {
		t.Errorf("the two copies opened %d connections, want 8", n)
	}
}

// pythonScript exercises what libnbd's python binding can send. Strict mode is off so
// that bad requests reach the server instead of being refused by libnbd itself.
const pythonScript = `
import nbd, sys
uri, size, bad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(uri)
assert h.get_size() == size, h.get_size()
assert h.get_structured_replies_negotiated()
for f in ("can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_multi_conn"):
    assert getattr(h, f)(), f

def expect_error(name, code, fn):
    try:
        fn()
    except nbd.Error as e:
        assert e.errno == code, "%s: got %s, want %s (%s)" % (name, e.errno, code, e.string)
        # The connection must go on after the error.
        assert len(h.pread(512, 0)) == 512, name + ": read after error"
        print("error ok:", name, e.errno)
        return
    raise AssertionError(name + ": no error")

buf = bytes((i * 7) & 0xff for i in range(65536))
h.pwrite(buf, 0)
h.pwrite(buf, 65536, nbd.CMD_FLAG_FUA)
assert h.pread(65536, 65536) == buf
h.flush()
h.trim(4096, 131072)
h.trim(4096, 135168, nbd.CMD_FLAG_FUA)
h.zero(8192, 0)
h.zero(4096, 8192, nbd.CMD_FLAG_NO_HOLE)
h.zero(4096, 12288, nbd.CMD_FLAG_FAST_ZERO)
h.zero(4096, 16384, nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_NO_HOLE | nbd.CMD_FLAG_FUA)
assert h.pread(20480, 0) == bytes(20480), "zeroed range does not read as zeroes"
assert h.pread(65536 - 20480, 20480) == buf[20480:]
h.cache(65536, 0)

expect_error("read past end", "EINVAL", lambda: h.pread(4096, size - 2048))
expect_error("read beyond end", "EINVAL", lambda: h.pread(512, size + 4096))
expect_error("write past end", "ENOSPC", lambda: h.pwrite(b"x" * 4096, size - 2048))
expect_error("zero past end", "ENOSPC", lambda: h.zero(8192, size - 4096))
expect_error("trim past end", "EINVAL", lambda: h.trim(8192, size - 4096))
expect_error("backend read error", "EIO", lambda: h.pread(4096, bad))
expect_error("backend read error, partly", "EIO", lambda: h.pread(65536, bad - 32768))
# Around the bad range all is well.
assert len(h.pread(4096, bad - 4096)) == 4096
assert len(h.pread(4096, bad + 4096)) == 4096
h.shutdown()
print("done")
`

func TestPythonLibnbd(t *testing.T) {
	t.Parallel()
	py := testtool.NeedPythonNBD(t)
	const size, bad = 2 << 20, 1 << 20
	mem := newMem(size)
	mem.hook = failRange("read", bad, bad+4096, fmt.Errorf("injected: %w", syscall.EIO))
	path := serveUnix(t, oneExportServer(mem, nil))
	script := filepath.Join(t.TempDir(), "t.py")
	if err := os.WriteFile(script, []byte(pythonScript), 0o600); err != nil {
		t.Fatal(err)
	}
	out := run(t, time.Minute, py, script, uriFor(path, ""), fmt.Sprint(size), fmt.Sprint(bad))
	t.Log(out)
	if !strings.Contains(out, "done") || strings.Count(out, "error ok") != 7 {
		t.Fatalf("script output:\n%s", out)
	}
	// What the backend saw, in order; flags must have travelled intact.
	want := []op{
		{"write", 0, 65536, 0},
		{"write", 65536, 65536, FUA},
		{"flush", 0, 0, 0},
		{"trim", 131072, 4096, 0},
		{"trim", 135168, 4096, FUA},
		{"zero", 0, 8192, 0},
		{"zero", 8192, 4096, NoHole},
		{"zero", 12288, 4096, FastZero},
		{"zero", 16384, 4096, FastZero | NoHole | FUA},
	}
	ops := mem.opsCopy()
	if len(ops) < len(want) {
		t.Fatalf("backend saw %+v", ops)
	}
	for i, w := range want {
		if ops[i] != w {
			t.Errorf("backend op %d: %+v, want %+v", i, ops[i], w)
		}
	}
	// Beyond those, only the flush at disconnect.
	for _, o := range ops[len(want):] {
		if o.name != "flush" {
			t.Errorf("unexpected backend op %+v", o)
		}
	}
}

func TestQemuImgConvert(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "qemu-img", "qemu-utils")
	const size = 16 << 20
	mem := newMem(size)
	path := serveUnix(t, oneExportServer(mem, nil))
	dir := t.TempDir()
	src := filepath.Join(dir, "in.raw")
	want := randomBytes(t, size)
	// Leave holes so qemu-img's zero detection and write-zeroes paths run too.
	clear(want[1<<20 : 3<<20])
	if err := os.WriteFile(src, want, 0o600); err != nil {
		t.Fatal(err)
	}
	mem.fill(0x77)
	// Into the export (-n: the target exists, do not create it).
	run(t, time.Minute, "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, uriFor(path, ""))
	mustEqual(t, "export after qemu-img convert", mem.snapshot(), want)
	// And out of it.
	dst := filepath.Join(dir, "out.raw")
	run(t, time.Minute, "qemu-img", "convert", "-f", "raw", "-O", "raw", uriFor(path, ""), dst)
	got, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "file after qemu-img convert", got, want)
}

func TestQemuIO(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "qemu-io", "qemu-utils")
	mem := newMem(8 << 20)
	mem.fill(0x11)
	path := serveUnix(t, oneExportServer(mem, nil))
	out := run(t, time.Minute, "qemu-io", "-f", "raw",
		"-c", "write -P 0xab 0 64k",
		"-c", "write -P 0xcd -f 1m 64k", // -f: FUA
		"-c", "read -P 0xab 0 64k",
		"-c", "read -P 0xcd 1m 64k",
		"-c", "flush",
		"-c", "discard 4k 8k",
		"-c", "write -z 2m 64k",
		"-c", "read -P 0 2m 64k",
		uriFor(path, ""))
	t.Log(out)
	for _, bad := range []string{"failed", "error", "Pattern verification"} {
		if strings.Contains(strings.ToLower(out), strings.ToLower(bad)) {
			t.Fatalf("qemu-io reported %q:\n%s", bad, out)
		}
	}
	if strings.Count(out, "wrote ") != 3 || strings.Count(out, "read ") != 3 || !strings.Contains(out, "discard 8192/8192") {
		t.Fatalf("qemu-io did not run every command:\n%s", out)
	}
	data := mem.snapshot()
	mustEqual(t, "first write", data[:4096], bytes.Repeat([]byte{0xab}, 4096))
	mustEqual(t, "FUA write", data[1<<20:1<<20+65536], bytes.Repeat([]byte{0xcd}, 65536))
	mustEqual(t, "zeroed", data[2<<20:2<<20+65536], make([]byte, 65536))
	var fua, flush, trim bool
	for _, o := range mem.opsCopy() {
		switch {
		case o.name == "write" && o.off == 1<<20 && o.flags&FUA != 0:
			fua = true
		case o.name == "flush":
			flush = true
		case o.name == "trim" && o.off == 4096 && o.n == 8192:
			trim = true
		}
	}
	if !fua || !flush || !trim {
		t.Errorf("backend saw FUA write %v, flush %v, trim %v", fua, flush, trim)
	}
}

// TestFio runs fio's nbd engine with data verification, and checks that verification
// bites: a backend that corrupts reads must make fio fail.
func TestFio(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "fio", "fio")
	if out, err := exec.Command("fio", "--enghelp=nbd").CombinedOutput(); err != nil || !strings.Contains(string(out), "uri") {
		t.Skipf("fio has no nbd engine: %v %s", err, out)
	}
	fio := func(path string) (string, error) {
		return runErr(2*time.Minute, "fio", "--name=verify", "--ioengine=nbd", "--uri="+uriFor(path, ""),
			"--rw=randrw", "--bs=4k", "--size=16m", "--iodepth=16", "--verify=crc32c",
			"--verify_fatal=1", "--verify_state_save=0", "--runtime=20", "--output-format=terse")
	}
	t.Run("good", func(t *testing.T) {
		t.Parallel()
		path := serveUnix(t, oneExportServer(newMem(16<<20), nil))
		if out, err := fio(path); err != nil {
			t.Fatalf("fio: %v\n%s", err, out)
		}
	})
	t.Run("corrupting backend is caught", func(t *testing.T) {
		t.Parallel()
		mem := newMem(16 << 20)
		var reads atomic.Int64
		path := serveUnix(t, oneExportServer(corruptReads{mem, &reads}, nil))
		out, err := fio(path)
		if err == nil {
			t.Fatalf("fio passed verification against a corrupting backend:\n%s", out)
		}
		if reads.Load() == 0 {
			t.Fatalf("fio failed without reading: %v\n%s", err, out)
		}
	})
}

// corruptReads flips a bit in every read of data that was ever written.
type corruptReads struct {
	*memBackend
	reads *atomic.Int64
}

func (c corruptReads) ReadAt(p []byte, off int64) error {
	if err := c.memBackend.ReadAt(p, off); err != nil {
		return err
	}
	c.reads.Add(1)
	if len(p) > 100 {
		p[100] ^= 1
	}
	return nil
}

// TestSIGTERM runs the server as its own process, as eli attach does, and checks that
// SIGTERM drains requests in flight, flushes and exits cleanly.
func TestSIGTERM(t *testing.T) {
	t.Parallel()
	exe, err := os.Executable()
	if err != nil {
		t.Skipf("cannot find the test binary: %v", err)
	}
	dir := shortTempDir(t)
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, make([]byte, 8<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s")
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), "NBD_TEST_SERVE="+sock+" "+img)
	var logs bytes.Buffer
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() })
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("server never listened:\n%s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	rc, _ := mustConnect(t, sock, true)
	const n = 32
	want := randomBytes(t, n*65536)
	for h := uint64(0); h < n; h++ {
		if err := rc.send(nbdproto.CmdWrite, 0, h, h*65536, 65536, want[h*65536:(h+1)*65536]); err != nil {
			t.Fatal(err)
		}
	}
	// Wait for the first reply so the writes are in the server, then stop it.
	first, err := rc.readReply()
	if err != nil || first.err != 0 {
		t.Fatalf("first reply: %+v %v", first, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Every write is answered: done, or refused with ESHUTDOWN if it arrived after the
	// server began to stop.
	done := map[uint64]bool{first.handle: true}
	for i := 1; i < n; i++ {
		r, err := rc.readReply()
		if err != nil || (r.err != 0 && r.err != nbdproto.EShutdown) {
			t.Fatalf("reply %d after SIGTERM: %+v %v\n%s", i, r, err, logs.String())
		}
		if r.err == 0 {
			done[r.handle] = true
		}
	}
	rc.expectClosed(t)
	t.Logf("%d writes done, %d refused with ESHUTDOWN", len(done), n-len(done))
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("server exit: %v\n%s", err, logs.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("server still running 20s after SIGTERM:\n%s", logs.String())
	}
	got, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	for h := range done {
		mustEqual(t, fmt.Sprintf("write %d after SIGTERM", h), got[h*65536:(h+1)*65536], want[h*65536:(h+1)*65536])
	}
	if _, err := os.Stat(sock); err == nil {
		t.Error("socket left behind after a clean exit")
	}
	t.Log(logs.String())
}

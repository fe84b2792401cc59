package control

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/memscan"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/keys"
	"golang.org/x/sys/unix"
)

// serve starts a server on a socket in a new directory and closes it with the test.
func serve(t *testing.T, setup ...func(*Server)) *Server {
	t.Helper()
	s, err := Listen(filepath.Join(t.TempDir(), "vol"+Ext), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range setup {
		f(s)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	t.Cleanup(func() {
		s.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return s
}

type echoArgs struct {
	Word string `json:"word"`
}

type echoResult struct {
	Word   string `json:"word"`
	Secret int    `json:"secret"`
	UID    int    `json:"uid"`
	PID    int    `json:"pid"`
}

func echo(ctx context.Context, req *Request) (any, error) {
	var a echoArgs
	if err := req.Decode(&a); err != nil {
		return nil, err
	}
	return echoResult{Word: a.Word, Secret: len(req.Secret), UID: req.Peer.UID, PID: req.Peer.PID}, nil
}

func TestCall(t *testing.T) {
	t.Parallel()
	s := serve(t)
	var gotSecret []byte
	s.Register("echo", echo)
	s.Register("secret", func(ctx context.Context, req *Request) (any, error) {
		gotSecret = append([]byte(nil), req.Secret...)
		return nil, nil
	})
	s.Register("refuse", func(ctx context.Context, req *Request) (any, error) {
		return nil, Errorf("not-suspended", "vol is not suspended")
	})
	s.Register("fail", func(ctx context.Context, req *Request) (any, error) {
		return nil, fmt.Errorf("commit: %w", io.ErrUnexpectedEOF)
	})
	ctx := context.Background()

	var r echoResult
	if err := Call(ctx, s.Path(), "echo", echoArgs{Word: "hello"}, []byte("k3y"), &r); err != nil {
		t.Fatal(err)
	}
	if r.Word != "hello" || r.Secret != 3 || r.UID != os.Geteuid() || r.PID != os.Getpid() {
		t.Errorf("echo: %+v; want hello, a secret of 3 bytes, uid %d, pid %d", r, os.Geteuid(), os.Getpid())
	}
	secret := []byte{0, 1, 2, 0xff, '"', '\n'}
	if err := Call(ctx, s.Path(), "secret", nil, secret, nil); err != nil {
		t.Fatal(err)
	}
	if string(gotSecret) != string(secret) {
		t.Errorf("the handler got the secret %x, want %x", gotSecret, secret)
	}

	for _, c := range []struct {
		op   string
		args any
		want *Error
		msg  string
	}{
		{"nosuch", nil, ErrUnknownOp, `does not know the operation "nosuch"`},
		{"echo", nil, ErrBadRequest, "echo takes arguments"},
		{"echo", map[string]any{"word": "x", "extra": 1}, ErrBadRequest, `unknown field "extra"`},
		{"refuse", nil, &Error{Code: "not-suspended"}, "vol is not suspended"},
		{"fail", nil, ErrFailed, "commit: unexpected EOF"},
	} {
		err := Call(ctx, s.Path(), c.op, c.args, nil, nil)
		var ce *Error
		if !errors.Is(err, c.want) || !errors.As(err, &ce) || !strings.Contains(ce.Message, c.msg) || ce.Op != c.op {
			t.Errorf("%s %v: %v; want code %s saying %q", c.op, c.args, err, c.want.Code, c.msg)
		}
	}
	if errors.Is(Errorf("not-suspended", "x"), ErrFailed) {
		t.Error("an error of one code matches another")
	}
}

func TestNoServer(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	err := Call(context.Background(), filepath.Join(dir, "gone"+Ext), "status", nil, nil, nil)
	if !errors.Is(err, ErrNoServer) {
		t.Errorf("no socket: %v, want ErrNoServer", err)
	}
	// A socket nobody accepts on (a killed server's).
	l, err := net.Listen("unix", filepath.Join(dir, "dead"+Ext))
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	if err := Call(context.Background(), filepath.Join(dir, "dead"+Ext), "status", nil, nil, nil); !errors.Is(err, ErrNoServer) {
		t.Errorf("dead socket: %v, want ErrNoServer", err)
	}
}

// TestLongPath: a path longer than a socket address holds is refused with a message
// that says so.
func TestLongPath(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for len(dir) < 120 {
		dir = filepath.Join(dir, "a-rather-long-directory-name")
	}
	if _, err := Listen(filepath.Join(dir, "vol"+Ext), nil); err == nil || !strings.Contains(err.Error(), "choose a shorter state directory") {
		t.Errorf("a %d-byte path: %v", len(dir), err)
	}
}

// rawCall sends b on a new connection and returns the reply's JSON, or why there is
// none.
func rawCall(t *testing.T, path string, b []byte) (string, error) {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	c.Write(b)
	r, err := readFrame(c, MaxMessage)
	return string(r), err
}

func rawRequest(h string, secret int) []byte {
	return append(frame([]byte(h)), make([]byte, secret)...)
}

// TestBadRequests: whatever a caller sends is bounded before it is trusted, and
// answered with a code.
func TestBadRequests(t *testing.T) {
	t.Parallel()
	s := serve(t)
	s.Register("echo", echo)
	huge := binary.BigEndian.AppendUint32(nil, MaxMessage+1)
	for _, c := range []struct {
		name string
		b    []byte
		want string
	}{
		{"oversized message", huge, "larger than"},
		{"not JSON", frame([]byte("{")), "request:"},
		{"another version", rawRequest(`{"v":2,"op":"echo"}`, 0), "protocol version 2"},
		{"no operation", rawRequest(`{"v":1}`, 0), "names no operation"},
		{"oversized secret", rawRequest(fmt.Sprintf(`{"v":1,"op":"echo","secret":%d}`, MaxSecret+1), 0), "a secret of"},
		{"negative secret", rawRequest(`{"v":1,"op":"echo","secret":-1}`, 0), "a secret of"},
	} {
		got, err := rawCall(t, s.Path(), c.b)
		if err != nil || !strings.Contains(got, `"code":"bad-request"`) || !strings.Contains(got, c.want) {
			t.Errorf("%s: %s, %v; want bad-request saying %q", c.name, got, err, c.want)
		}
	}
	if err := Call(context.Background(), s.Path(), "echo", echoArgs{}, make([]byte, MaxSecret+1), nil); !errors.Is(err, ErrBadRequest) {
		t.Errorf("Call with an oversized secret: %v", err)
	}
	// The server still answers.
	var r echoResult
	if err := Call(context.Background(), s.Path(), "echo", echoArgs{Word: "ok"}, nil, &r); err != nil || r.Word != "ok" {
		t.Errorf("after the bad requests: %+v, %v", r, err)
	}
}

// TestSlowClients: a caller that sends part of a request and stalls is dropped after
// the server's I/O timeout; MaxConns of them make the next caller busy, not blocked, and
// once they are dropped the server answers again.
func TestSlowClients(t *testing.T) {
	t.Parallel()
	s := serve(t, func(s *Server) { s.ioTimeout = 3 * time.Second })
	s.Register("echo", echo)
	var stalled []net.Conn
	for range MaxConns {
		c, err := net.Dial("unix", s.Path())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write(rawRequest(`{"v":1,"op":"echo","secret":10}`, 4)) // 6 bytes of the secret missing
		stalled = append(stalled, c)
	}
	for deadline := time.Now().Add(10 * time.Second); len(s.sem) < MaxConns; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the server took %d of %d stalled callers in", len(s.sem), MaxConns)
		}
	}
	if err := Call(context.Background(), s.Path(), "echo", echoArgs{}, nil, nil); !errors.Is(err, ErrBusy) {
		t.Errorf("with %d stalled callers: %v, want ErrBusy", MaxConns, err)
	}
	for i, c := range stalled {
		c.SetDeadline(time.Now().Add(30 * time.Second))
		got, err := readFrame(c, MaxMessage)
		if err != nil || !strings.Contains(string(got), "bad-request") || !strings.Contains(string(got), "timeout") {
			t.Errorf("stalled caller %d: %s, %v; want a bad request that timed out", i, got, err)
		}
		if _, err := c.Read(make([]byte, 1)); err != io.EOF {
			t.Errorf("stalled caller %d: connection not closed: %v", i, err)
		}
	}
	var r echoResult
	if err := Call(context.Background(), s.Path(), "echo", echoArgs{Word: "again"}, nil, &r); err != nil || r.Word != "again" {
		t.Errorf("once the stalled callers are dropped: %+v, %v", r, err)
	}
}

// TestDeadlines: the handler's context ends at the caller's deadline, when the caller
// hangs up, and when the server closes; Close waits for the handlers.
func TestDeadlines(t *testing.T) {
	t.Parallel()
	s := serve(t)
	ended := make(chan error, 1)
	started := make(chan struct{}, 1)
	s.Register("wait", func(ctx context.Context, req *Request) (any, error) {
		started <- struct{}{}
		<-ctx.Done()
		ended <- ctx.Err()
		return nil, ctx.Err()
	})

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := Call(ctx, s.Path(), "wait", nil, nil, nil); !errors.Is(err, ErrTimeout) {
		t.Errorf("past its deadline: %v, want ErrTimeout", err)
	}
	<-started
	if err := waitFor(ended); err == nil {
		t.Error("the handler's context did not end with the caller's deadline")
	}

	ctx, cancel = context.WithCancel(context.Background())
	go func() { <-started; cancel() }()
	if err := Call(ctx, s.Path(), "wait", nil, nil, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	if err := waitFor(ended); !errors.Is(err, context.Canceled) {
		t.Errorf("the handler's context did not end when the caller hung up: %v", err)
	}

	callErr := make(chan error, 1)
	go func() { callErr <- Call(context.Background(), s.Path(), "wait", nil, nil, nil) }()
	<-started
	s.Close() // returns once the handler has
	select {
	case err := <-ended:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("the handler's context at Close: %v", err)
		}
	default:
		t.Error("Close returned before the handler")
	}
	if err := waitFor(callErr); !errors.Is(err, ErrFailed) {
		t.Errorf("a call cut short by Close: %v", err)
	}
	if _, err := os.Lstat(s.Path()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the socket is still there after Close: %v", err)
	}
	if err := Call(context.Background(), s.Path(), "wait", nil, nil, nil); !errors.Is(err, ErrNoServer) {
		t.Errorf("after Close: %v", err)
	}
}

func waitFor(c <-chan error) error {
	select {
	case err := <-c:
		return err
	case <-time.After(30 * time.Second):
		return errors.New("nothing within 30 s")
	}
}

func TestAllowed(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		peer, server int
		want         bool
	}{{0, 1000, true}, {1000, 1000, true}, {1001, 1000, false}, {0, 0, true}, {1000, 0, false}} {
		if got := allowed(c.peer, c.server); got != c.want {
			t.Errorf("uid %d calling a server of uid %d: allowed %v", c.peer, c.server, got)
		}
	}
}

// TestOtherUserDenied calls the server from a process of another user, which the
// socket's mode would keep out; opened to it here, the peer's credentials do.
func TestOtherUserDenied(t *testing.T) {
	if path := os.Getenv("ELI_CONTROL_TEST_CALL"); path != "" {
		// The caller, as another user.
		err := Call(context.Background(), path, "echo", echoArgs{Word: "x"}, []byte("secret"), nil)
		fmt.Printf("uid %d: %v\n", os.Geteuid(), err)
		if !errors.Is(err, ErrDenied) {
			os.Exit(3)
		}
		os.Exit(0)
	}
	testtool.NeedRoot(t)
	t.Parallel()
	s := serve(t)
	var called atomic.Bool
	s.Register("echo", func(ctx context.Context, req *Request) (any, error) { called.Store(true); return nil, nil })
	// The test binary and the socket, where the other user reaches them.
	dir, err := os.MkdirTemp("", "eli-control-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "control.test")
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{dir, filepath.Dir(s.Path())} {
		for ; p != "/" && p != os.TempDir(); p = filepath.Dir(p) {
			os.Chmod(p, 0o755)
		}
	}
	if err := os.Chmod(s.Path(), 0o666); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run=^TestOtherUserDenied$")
	cmd.Env = append(os.Environ(), "ELI_CONTROL_TEST_CALL="+s.Path())
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("the call as uid 65534: %v: %s", err, out)
	}
	if !strings.Contains(string(out), "uid 65534 may not control this server") {
		t.Errorf("the denial does not say why: %s", out)
	}
	if called.Load() {
		t.Error("the handler ran for another user")
	}
}

// TestSecretWiped: the secret part is in the server's memory while the handler runs,
// and nowhere once the call is over and the caller has wiped its own copy.
func TestSecretWiped(t *testing.T) {
	// Not parallel: a scan of this process's memory should see nothing else's secrets.
	s := serve(t)
	// The pattern lives in a mapping of its own, which memscan skips as its pattern.
	pat, err := unix.Mmap(-1, 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(pat)
	pat = pat[:48]
	sec := keys.NewSecret(len(pat))
	defer sec.Wipe()
	// Not crypto/rand, whose generator may keep copies of its output on a stack.
	b := sec.Bytes()
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	copyBytes(pat, b)

	var during *memscan.Report
	var scanErr error
	s.Register("take", func(ctx context.Context, req *Request) (any, error) {
		during, scanErr = memscan.Scan(0, pat)
		return nil, nil
	})
	if err := Call(context.Background(), s.Path(), "take", map[string]int{"n": 1}, sec.Bytes(), nil); err != nil {
		t.Fatal(err)
	}
	if scanErr != nil {
		t.Fatal(scanErr)
	}
	if n := len(during.Matches); n < 2 {
		t.Fatalf("the secret was found %d times while the handler ran, want the caller's copy and the server's: %v", n, during.Matches)
	}
	sec.Wipe()
	after, err := memscan.Scan(0, pat)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range after.Matches {
		t.Errorf("the secret is still in memory after the call: %v", m)
	}
}

// copyBytes copies a byte at a time: copy may pass the bytes through vector registers,
// which a signal can save where a scan finds them (see memscan).
//
//go:noinline
func copyBytes(dst, src []byte) {
	for i := range src {
		dst[i] = src[i]
	}
}

func TestConcurrentCalls(t *testing.T) {
	t.Parallel()
	s := serve(t)
	s.Register("echo", echo)
	var wg sync.WaitGroup
	errs := make(chan error, 4*MaxConns)
	for i := range 4 * MaxConns {
		wg.Go(func() {
			word := fmt.Sprint(i)
			var r echoResult
			for {
				err := Call(context.Background(), s.Path(), "echo", echoArgs{Word: word}, nil, &r)
				if errors.Is(err, ErrBusy) {
					time.Sleep(time.Millisecond)
					continue
				}
				if err == nil && r.Word != word {
					err = fmt.Errorf("sent %s, got %s back", word, r.Word)
				}
				errs <- err
				return
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// TestHugeTimeout: a caller's timeout is bounded before it is turned into a duration: one
// of centuries (a raw client's, or one whose clock is off) gives the handler
// MaxCallTimeout, not a deadline that an overflow put in the past.
func TestHugeTimeout(t *testing.T) {
	t.Parallel()
	s := serve(t)
	s.Register("left", func(ctx context.Context, req *Request) (any, error) {
		d, ok := ctx.Deadline()
		if !ok {
			return nil, errors.New("no deadline")
		}
		return time.Until(d), ctx.Err()
	})
	for _, ms := range []int64{1 << 62, 10_000_000_000_000, 9_223_372_036_854_776} {
		got, err := rawCall(t, s.Path(), rawRequest(fmt.Sprintf(`{"v":1,"op":"left","timeout_ms":%d}`, ms), 0))
		var r struct {
			Result time.Duration `json:"result"`
		}
		if err != nil || json.Unmarshal([]byte(got), &r) != nil || r.Result < MaxCallTimeout-time.Minute || r.Result > MaxCallTimeout {
			t.Errorf("timeout_ms %d: %s, %v; want about %v left", ms, got, err, MaxCallTimeout)
		}
	}
}

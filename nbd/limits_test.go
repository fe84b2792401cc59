package nbd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
	"github.com/elidisk/eli/internal/testtool"
)

// TestLargeRequestsLibnbd: libnbd writes and reads 64 MiB in one request each (the
// advertised maximum), and the backend sees them whole.
func TestLargeRequestsLibnbd(t *testing.T) {
	t.Parallel()
	py := testtool.NeedPythonNBD(t)
	mem := newMem(96 << 20)
	path := serveUnix(t, oneExportServer(mem, nil))
	script := filepath.Join(t.TempDir(), "t.py")
	const src = `import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
print("max", h.get_block_size(nbd.SIZE_MAXIMUM))
buf = bytes((i * 7) & 0xff for i in range(1 << 16)) * 1024
h.pwrite(buf, 4096)
got = h.pread(len(buf), 4096)
print("same", got == buf)
h.shutdown()
`
	if err := os.WriteFile(script, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	out := run(t, 2*time.Minute, py, script, uriFor(path, ""))
	if !strings.Contains(out, fmt.Sprintf("max %d", MaxRequest)) || !strings.Contains(out, "same True") {
		t.Fatalf("script output:\n%s", out)
	}
	for _, o := range mem.opsCopy() {
		if o.name == "write" && o.n != 64<<20 {
			t.Errorf("the 64 MiB write reached the backend as %+v", o)
		}
	}
}

// TestOversizedWriteIsRefused: a WRITE above the export's maximum block size, or above
// MaxRequest, has its payload skipped and gets EINVAL; the connection goes on.
func TestOversizedWriteIsRefused(t *testing.T) {
	t.Parallel()
	mem := newMem(128 << 20)
	srv := &Server{Exports: []Export{{Name: "", Backend: mem}, {Name: "small", Backend: newMem(4 << 20), MaxBlock: 1 << 20}}}
	path := serveUnix(t, srv)
	for _, tc := range []struct {
		export string
		n      uint32
	}{{"", MaxRequest + 4096}, {"small", 2 << 20}} {
		for _, structured := range []bool{false, true} {
			rc := dialRaw(t, path)
			if _, err := rc.connect(tc.export, structured); err != nil {
				t.Fatal(err)
			}
			if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 0, tc.n, make([]byte, tc.n)); r.err != nbdproto.EInval {
				t.Fatalf("%q: write of %d bytes: error %d, want EINVAL", tc.export, tc.n, r.err)
			}
			if r := rc.roundTrip(t, nbdproto.CmdRead, 0, 0, 4096, nil); r.err != 0 || len(r.data) != 4096 {
				t.Fatalf("%q: read after the refused write: %+v", tc.export, r)
			}
		}
	}
	if len(mem.opsCopy()) != 0 {
		t.Fatalf("a refused write reached the backend: %+v", mem.opsCopy())
	}
}

// TestLargeCache: NBD_CMD_CACHE is bound by the export's size, not the maximum block size:
// it holds no buffer. Raw, then with libnbd.
func TestLargeCache(t *testing.T) {
	t.Parallel()
	mem := newMem(128 << 20)
	cm := cachingMem{mem, make(chan [2]int64, 1)}
	path := serveUnix(t, oneExportServer(cm, func(e *Export) { e.MaxBlock = 1 << 20 }))
	rc, _ := mustConnect(t, path, true)
	if r := rc.roundTrip(t, nbdproto.CmdCache, 0, 0, 96<<20, nil); r.err != 0 {
		t.Fatalf("96 MiB cache: error %d %s", r.err, r.msg)
	}
	if got := <-cm.calls; got != [2]int64{0, 96 << 20} {
		t.Fatalf("Cache called with %v", got)
	}
	if r := rc.roundTrip(t, nbdproto.CmdCache, 0, 64<<20, 96<<20, nil); r.err != nbdproto.EInval {
		t.Fatalf("cache past the end: error %d", r.err)
	}

	// A real client: libnbd sends the same 96 MiB CACHE.
	py := testtool.NeedPythonNBD(t)
	script := filepath.Join(t.TempDir(), "t.py")
	const src = `import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
print("can_cache", h.can_cache(), "max", h.get_block_size(nbd.SIZE_MAXIMUM))
h.cache(96 << 20, 0)
print("cached")
h.shutdown()
`
	if err := os.WriteFile(script, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	out := run(t, time.Minute, py, script, uriFor(path, ""))
	if !strings.Contains(out, "can_cache True max 1048576") || !strings.Contains(out, "cached") {
		t.Fatalf("script output:\n%s", out)
	}
	if got := <-cm.calls; got != [2]int64{0, 96 << 20} {
		t.Fatalf("libnbd's CACHE reached the backend as %v", got)
	}
}

// TestShutdownDuringHandshake: options arriving while the server shuts down get
// NBD_REP_ERR_SHUTDOWN, and NBD_OPT_ABORT still its ACK.
func TestShutdownDuringHandshake(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(1<<20), nil)
	srv.drainTime = 20 * time.Second // the client below takes its time on a busy machine
	path := serveUnix(t, srv)
	rc := dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle)
	rc.sendOpt(nbdproto.OptList, nil)
	if _, err := rc.readOptReplies(); err != nil {
		t.Fatal(err)
	}
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		shut <- srv.Shutdown(ctx)
	}()
	waitFor(t, "shutdown begins", srv.closing)
	for _, opt := range []uint32{nbdproto.OptList, nbdproto.OptGo} {
		rc.sendOpt(opt, goData(""))
		r, err := rc.readOptReply()
		if err != nil || r.typ != nbdproto.RepErrShutdown {
			t.Fatalf("option %d during shutdown: %+v %v, want NBD_REP_ERR_SHUTDOWN", opt, r, err)
		}
	}
	rc.sendOpt(nbdproto.OptAbort, nil)
	if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepAck {
		t.Fatalf("abort during shutdown: %+v %v", r, err)
	}
	rc.expectClosed(t)
	if err := <-shut; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
}

// TestHandshakeAdmission: idle sockets cannot lock clients out. With the handshakes full,
// a new connection evicts the oldest idle one and completes its handshake; an idle socket
// is closed after HandshakeTimeout.
func TestHandshakeAdmission(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(1<<20), nil)
	srv.MaxHandshakes = 4
	srv.MaxConns = 8
	path := serveUnix(t, srv)
	var idle []*rawClient
	for range 4 {
		rc := dialRaw(t, path)
		rc.greet(nbdproto.FlagCFixedNewstyle) // then nothing
		idle = append(idle, rc)
	}
	waitFor(t, "the idle sockets are in the handshake", func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		return len(srv.conns) == 4
	})
	// A real client gets in, and the oldest idle socket is gone.
	rc, _ := mustConnect(t, path, true)
	if r := rc.roundTrip(t, nbdproto.CmdRead, 0, 0, 4096, nil); r.err != 0 {
		t.Fatalf("read: %+v", r)
	}
	idle[0].expectClosed(t)

	// MaxConns: with every slot in transmission, a newcomer is refused.
	srv2 := oneExportServer(newMem(1<<20), nil)
	srv2.MaxConns = 2
	path2 := serveUnix(t, srv2)
	mustConnect(t, path2, false)
	mustConnect(t, path2, false)
	late := dialRaw(t, path2)
	late.expectClosed(t)

	// An idle socket is dropped after the handshake timeout.
	srv3 := oneExportServer(newMem(1<<20), nil)
	srv3.HandshakeTimeout = 200 * time.Millisecond
	slow := dialRaw(t, serveUnix(t, srv3))
	slow.greet(nbdproto.FlagCFixedNewstyle)
	slow.expectClosed(t)
}

// TestMaxConnsPerSource: over TCP, one address gets at most MaxConnsPerSource
// connections; the rest of the server stays open to others (here: after one leaves).
func TestMaxConnsPerSource(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(1<<20), nil)
	srv.AllowInsecureTCP = true
	srv.MaxConnsPerSource = 2
	addr := serveTCP(t, srv)
	dial := func() *rawClient {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(20 * time.Second))
		t.Cleanup(func() { c.Close() })
		return &rawClient{c: c, readLens: map[uint64]uint32{}}
	}
	a, b := dial(), dial()
	for _, rc := range []*rawClient{a, b} {
		if _, err := rc.connect("", false); err != nil {
			t.Fatal(err)
		}
	}
	// The third is closed without a greeting.
	third := dial()
	if got, err := io.ReadAll(third.c); len(got) != 0 || (err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset")) {
		t.Fatalf("third connection from one address: got % x, %v", got, err)
	}
	a.send(nbdproto.CmdDisc, 0, 0, 0, 0, nil)
	a.expectClosed(t)
	waitFor(t, "a slot frees", func() bool {
		rc := dial()
		_, err := rc.connect("", false)
		return err == nil
	})
}

// TestEvictionPrefersBusiestSource: over TCP, when the handshakes are full, the
// connection evicted for a newcomer is the oldest of the address with the most
// handshakes open, never the lone handshake of another address.
func TestEvictionPrefersBusiestSource(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(1<<20), nil)
	srv.AllowInsecureTCP = true
	srv.MaxHandshakes = 4
	addr := serveTCP(t, srv)
	dialFrom := func(ip string) *rawClient {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("cannot dial from %s: %v", ip, err)
		}
		c.SetDeadline(time.Now().Add(20 * time.Second))
		t.Cleanup(func() { c.Close() })
		rc := &rawClient{c: c, readLens: map[uint64]uint32{}}
		if _, err := rc.greet(nbdproto.FlagCFixedNewstyle); err != nil {
			t.Fatal(err)
		}
		return rc
	}
	handshakes := func(n int) func() bool {
		return func() bool {
			srv.mu.Lock()
			defer srv.mu.Unlock()
			return len(srv.conns) == n
		}
	}
	// The slow but honest client comes first, so it is the oldest of all.
	honest := dialFrom("127.0.0.2")
	var flood []*rawClient
	for range 3 {
		flood = append(flood, dialFrom("127.0.0.1"))
	}
	waitFor(t, "four handshakes are open", handshakes(4))
	// Three more from the flooding address each evict one of its own.
	for range 3 {
		flood = append(flood, dialFrom("127.0.0.1"))
	}
	for _, rc := range flood[:3] {
		rc.expectClosed(t)
	}
	// The honest client, the oldest of all, finishes its handshake and is served.
	honest.sendOpt(nbdproto.OptGo, goData(""))
	if _, err := honest.readOptReplies(); err != nil {
		t.Fatalf("the honest client was evicted: %v", err)
	}
	if r := honest.roundTrip(t, nbdproto.CmdRead, 0, 0, 4096, nil); r.err != 0 {
		t.Fatalf("read: %+v", r)
	}
}

// TestSourceAtItsBoundEvictsItsHandshakes (issue 42 item 2): 16 idle TCP connections from
// 127.0.0.1, as many as MaxConnsPerSource allows, do not lock out a normal client from the
// same address: it evicts the oldest of them and is served. Only connections of the
// address that are in transmission are never evicted.
func TestSourceAtItsBoundEvictsItsHandshakes(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(1<<20), nil)
	srv.AllowInsecureTCP = true
	addr := serveTCP(t, srv)
	idle := idleTCP(t, addr, DefaultMaxConnsPerSource)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(20 * time.Second))
	t.Cleanup(func() { c.Close() })
	rc := &rawClient{c: c, readLens: map[uint64]uint32{}}
	if _, err := rc.connect("", true); err != nil {
		t.Fatalf("a client from an address with %d idle connections: %v", len(idle), err)
	}
	if r := rc.roundTrip(t, nbdproto.CmdRead, 0, 0, 4096, nil); r.err != 0 {
		t.Fatalf("read: %+v", r)
	}
	// The oldest idle connection made room.
	idle[0].SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadAll(idle[0]); err != nil && !strings.Contains(err.Error(), "reset") {
		t.Fatalf("the oldest idle connection: %v, want it closed", err)
	}
}

package nbd

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// heldWrites is a backend whose writes each say they started on started and then wait
// for release to be closed.
func heldWrites() (mem *memBackend, started chan struct{}, release chan struct{}) {
	mem = newMem(4 << 20)
	started, release = make(chan struct{}, 16), make(chan struct{})
	mem.hook = func(name string, off, n int64, f Flags) error {
		if name == "write" {
			started <- struct{}{}
			<-release
		}
		return nil
	}
	return mem, started, release
}

// TestShutdownFinishesInFlight: Shutdown lets requests in flight finish and answers them,
// refuses requests still arriving with ESHUTDOWN, flushes the backend, closes every
// connection, and makes Serve return ErrServerClosed.
func TestShutdownFinishesInFlight(t *testing.T) {
	t.Parallel()
	mem, started, release := heldWrites()
	srv := oneExportServer(mem, nil)
	srv.Logger = testLogger(t)
	l, err := ListenUnix(filepath.Join(shortTempDir(t), "s"))
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()

	rc, _ := mustConnect(t, l.Addr().String(), true)
	idle, _ := mustConnect(t, l.Addr().String(), false)
	inHandshake := dialRaw(t, l.Addr().String())
	if _, err := inHandshake.greet(nbdproto.FlagCFixedNewstyle); err != nil {
		t.Fatal(err)
	}
	const n, late = 4, 3
	for h := uint64(0); h < n; h++ {
		rc.send(nbdproto.CmdWrite, 0, h, h*4096, 4096, pattern(4096, byte(h)))
	}
	for i := 0; i < n; i++ {
		<-started
	}
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		shut <- srv.Shutdown(ctx)
	}()
	// Requests sent once the server is stopping are refused, not run, not dropped.
	// (Shutdown marks itself closing and stops every connection in one critical section.)
	for !srv.closing() {
		time.Sleep(time.Millisecond)
	}
	for h := uint64(100); h < 100+late; h++ {
		rc.send(nbdproto.CmdWrite, 0, h, h*4096, 4096, pattern(4096, byte(h)))
	}
	for i := 0; i < late; i++ {
		r, err := rc.readReply()
		if err != nil || r.err != nbdproto.EShutdown || r.handle < 100 {
			t.Fatalf("late request: %+v %v, want ESHUTDOWN", r, err)
		}
	}
	close(release)
	for i := 0; i < n; i++ {
		r, err := rc.readReply()
		if err != nil || r.err != 0 || r.handle >= n {
			t.Fatalf("in-flight write: %+v %v", r, err)
		}
	}
	rc.expectClosed(t)
	idle.expectClosed(t)
	inHandshake.expectClosed(t)
	if err := <-shut; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if err := <-served; !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve: %v", err)
	}
	ops := mem.opsCopy()
	if len(ops) != n+1 || ops[n].name != "flush" {
		t.Fatalf("backend saw %+v, want %d writes then a flush", ops, n)
	}
	if _, err := net.Dial("unix", l.Addr().String()); err == nil {
		t.Error("listener still accepting after Shutdown")
	}
	if err := srv.Serve(l); !errors.Is(err, ErrServerClosed) {
		t.Errorf("Serve after Shutdown: %v", err)
	}
}

// TestShutdownTimeout: a backend that never returns cannot hold Shutdown past its context.
func TestShutdownTimeout(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	block := make(chan struct{})
	var srv *Server
	t.Cleanup(func() {
		close(block)
		// The connection logs its end once the read returns: let it, before the
		// test ends.
		srv.active.Wait()
	})
	started := make(chan struct{})
	mem.hook = func(name string, off, n int64, f Flags) error {
		if name == "read" {
			close(started)
			<-block
		}
		return nil
	}
	srv = oneExportServer(mem, nil)
	srv.Logger = testLogger(t)
	l, err := ListenUnix(filepath.Join(shortTempDir(t), "s"))
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	rc, _ := mustConnect(t, l.Addr().String(), true)
	rc.send(nbdproto.CmdRead, 0, 1, 0, 4096, nil)
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	begin := time.Now()
	if err := srv.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown: %v, want deadline exceeded", err)
	}
	if d := time.Since(begin); d > 5*time.Second {
		t.Fatalf("Shutdown took %v", d)
	}
	rc.expectClosed(t)
}

func TestMaxConns(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(4096), nil)
	srv.MaxConns = 2
	path := serveUnix(t, srv)
	a, _ := mustConnect(t, path, false)
	b, _ := mustConnect(t, path, false)
	c := dialRaw(t, path)
	c.expectClosed(t)
	// Closing one frees a slot.
	a.send(nbdproto.CmdDisc, 0, 0, 0, 0, nil)
	a.expectClosed(t)
	deadline := time.Now().Add(5 * time.Second)
	for {
		d := dialRaw(t, path)
		if _, err := d.connect("", false); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no slot freed after a client left")
		}
		time.Sleep(10 * time.Millisecond)
	}
	_ = b
}

func TestServeRefusesPlainTCP(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no TCP loopback: %v", err)
	}
	defer l.Close()
	srv := oneExportServer(newMem(4096), nil)
	if err := srv.Serve(l); !errors.Is(err, ErrInsecureListener) {
		t.Fatalf("Serve on plain TCP: %v, want ErrInsecureListener", err)
	}
	// Opting in works.
	srv2 := oneExportServer(newMem(4096), nil)
	srv2.AllowInsecureTCP = true
	srv2.Logger = testLogger(t)
	go srv2.Serve(l)
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	rc := &rawClient{c: c, readLens: map[uint64]uint32{}}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := rc.connect("", true); err != nil {
		t.Fatal(err)
	}
	c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv2.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestInvalidExports(t *testing.T) {
	t.Parallel()
	m := newMem(1 << 20)
	tests := []struct {
		name    string
		exports []Export
	}{
		{"none", nil},
		{"no backend", []Export{{Name: "a"}}},
		{"duplicate", []Export{{Name: "a", Backend: m}, {Name: "a", Backend: m}}},
		{"name too long", []Export{{Name: string(make([]byte, 4097)), Backend: m}}},
		{"NUL in name", []Export{{Name: "a\x00b", Backend: m}}},
		{"min block not power of two", []Export{{Backend: m, MinBlock: 384}}},
		{"min block too big", []Export{{Backend: m, MinBlock: 128 << 10}}},
		{"preferred below 512", []Export{{Backend: m, PreferredBlock: 256}}},
		{"max above MaxRequest", []Export{{Backend: m, MaxBlock: MaxRequest * 2}}},
		{"max not multiple of min", []Export{{Backend: m, MinBlock: 4096, MaxBlock: 6000}}},
		{"size not multiple of min", []Export{{Backend: newMem(1000), MinBlock: 512}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l, err := ListenUnix(filepath.Join(shortTempDir(t), "s"))
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			srv := &Server{Exports: tc.exports}
			if err := srv.Serve(l); err == nil || errors.Is(err, ErrServerClosed) {
				t.Fatalf("Serve accepted invalid exports: %v", err)
			}
		})
	}
}

// TestHandoverLeavesLateRequestsUnanswered: Handover finishes and answers the requests in
// flight and flushes, like Shutdown, but a request arriving once it started is neither
// run nor answered (the connection closes on it), so that a client re-plugged into a new
// server sends it again instead of failing it with ESHUTDOWN.
func TestHandoverLeavesLateRequestsUnanswered(t *testing.T) {
	t.Parallel()
	mem, started, release := heldWrites()
	srv := oneExportServer(mem, nil)
	srv.Logger = testLogger(t)
	const n, late = 3, 3
	// The reader takes the first late request off the wire and waits for room to run it
	// when Handover comes; the others are still unread.
	srv.MaxInFlightPerConn = n
	l, err := ListenUnix(filepath.Join(shortTempDir(t), "s"))
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()

	rc, _ := mustConnect(t, l.Addr().String(), true)
	for h := uint64(0); h < n; h++ {
		rc.send(nbdproto.CmdWrite, 0, h, h*4096, 4096, pattern(4096, byte(h)))
	}
	for i := 0; i < n; i++ {
		<-started
	}
	for h := uint64(100); h < 100+late; h++ {
		rc.send(nbdproto.CmdWrite, 0, h, h*4096, 4096, pattern(4096, byte(h)))
	}
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		shut <- srv.Handover(ctx)
	}()
	for !srv.closing() {
		time.Sleep(time.Millisecond)
	}
	close(release)
	for i := 0; i < n; i++ {
		r, err := rc.readReply()
		if err != nil || r.err != 0 || r.handle >= n {
			t.Fatalf("in-flight write: %+v %v, want its success", r, err)
		}
	}
	// Nothing more: no reply for the late writes, just the end of the connection.
	rc.expectClosed(t)
	if err := <-shut; err != nil {
		t.Fatalf("handover: %v", err)
	}
	if err := <-served; !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve: %v", err)
	}
	ops := mem.opsCopy()
	if len(ops) != n+1 || ops[n].name != "flush" {
		t.Fatalf("backend saw %+v, want the %d in-flight writes then a flush", ops, n)
	}
	for _, op := range ops[:n] {
		if op.off >= 100*4096 {
			t.Errorf("a late write ran: %+v", op)
		}
	}
}

// TestOnClients: the server tells how many clients are in the transmission phase each
// time the number changes, in order; a connection still in its handshake is no client.
func TestOnClients(t *testing.T) {
	t.Parallel()
	srv := oneExportServer(newMem(1<<20), nil)
	counts := make(chan int, 16)
	srv.OnClients = func(n int) { counts <- n }
	path := serveUnix(t, srv)
	handshaking := dialRaw(t, path)
	if _, err := handshaking.greet(nbdproto.FlagCFixedNewstyle | nbdproto.FlagCNoZeroes); err != nil {
		t.Fatal(err)
	}
	a, _ := mustConnect(t, path, true)
	b, _ := mustConnect(t, path, false)
	if r := a.roundTrip(t, nbdproto.CmdRead, 0, 0, 512, nil); r.err != 0 {
		t.Fatalf("read: %+v", r)
	}
	a.c.Close()
	b.c.Close()
	var got []int
	for len(got) < 4 {
		select {
		case n := <-counts:
			got = append(got, n)
		case <-time.After(time.Minute): // a hang guard
			t.Fatalf("clients reported: %v", got)
		}
	}
	if want := []int{1, 2, 1, 0}; !slices.Equal(got, want) {
		t.Fatalf("clients reported %v, want %v", got, want)
	}
	handshaking.c.Close()
	select {
	case n := <-counts:
		t.Fatalf("a connection that never chose an export changed the count to %d", n)
	case <-time.After(100 * time.Millisecond):
	}
}

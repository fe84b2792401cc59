package nbd

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// socketPair is two connected unix stream sockets as the net package returns them.
func socketPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f) // dups the descriptor
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i] = c
	}
	return conns[0], conns[1]
}

// TestRawConn: reads and writes by raw system calls keep net.Conn's contract: every
// byte in order across more than the socket's buffers (so that both sides wait in the
// poller), writev of several buffers, deadlines, EOF, and Close while a read waits.
func TestRawConn(t *testing.T) {
	t.Parallel()
	c1, c2 := socketPair(t)
	a, b := newRawConn(c1), newRawConn(c2)
	if _, ok := a.(*rawConn); !ok {
		t.Fatalf("newRawConn(%T) = %T, want *rawConn", c1, a)
	}
	if p1, _ := net.Pipe(); newRawConn(p1) != p1 {
		t.Fatal("a net.Pipe was wrapped")
	}

	// 8 MiB in three buffers (one empty) one way, and back in one Write; the deadline
	// turns a side that waits forever into a failure.
	a.SetDeadline(time.Now().Add(30 * time.Second))
	b.SetDeadline(time.Now().Add(30 * time.Second))
	want := make([]byte, 8<<20)
	for i := range want {
		want[i] = byte(i * 7 / 3)
	}
	errc := make(chan error, 1)
	go func() {
		n, err := a.(*rawConn).WriteBuffers([][]byte{want[:100], nil, want[100:]})
		if err == nil && n != int64(len(want)) {
			err = io.ErrShortWrite
		}
		errc <- err
	}()
	got := make([]byte, len(want))
	rng := rand.New(rand.NewPCG(1, 2))
	for off := 0; off < len(got); {
		n, err := b.Read(got[off:min(len(got), off+1+rng.IntN(300<<10))])
		if err != nil {
			t.Fatalf("read at %d: %v", off, err)
		}
		off += n
	}
	if err := <-errc; err != nil {
		t.Fatalf("WriteBuffers: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the bytes read are not the bytes written")
	}
	go func() {
		n, err := b.Write(want)
		if err == nil && n != len(want) {
			err = io.ErrShortWrite
		}
		errc <- err
	}()
	clear(got)
	if _, err := io.ReadFull(a, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("ReadFull back: %v (equal %v)", err, bytes.Equal(got, want))
	}
	if err := <-errc; err != nil {
		t.Fatalf("Write: %v", err)
	}

	// A read deadline ends a read that waits.
	b.SetDeadline(time.Time{})
	a.SetWriteDeadline(time.Time{})
	a.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := a.Read(got[:10]); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past its deadline: %v", err)
	}
	a.SetReadDeadline(time.Time{})

	// Close ends a read that waits, and later reads.
	go func() {
		time.Sleep(20 * time.Millisecond)
		a.Close()
	}()
	if _, err := a.Read(got[:10]); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read while the connection is closed: %v", err)
	}
	// The peer sees EOF, and a write to a closed peer fails.
	if n, err := b.Read(got[:10]); n != 0 || err != io.EOF {
		t.Fatalf("read from a closed peer: %d, %v", n, err)
	}
	if _, err := b.Write(want); err == nil {
		t.Fatal("a write to a closed peer succeeded")
	}
}

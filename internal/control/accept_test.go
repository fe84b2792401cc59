package control

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestOutOfDescriptors: a server that cannot accept a connection for want of file
// descriptors (EMFILE: a flood of NBD clients, a leak elsewhere in the process) goes on
// answering once it has them again, as the NBD server does; the control socket stays
// bound meanwhile, so a server that gave up would leave every later call (a resume of a
// suspended volume) waiting on a socket nobody accepts on.
func TestOutOfDescriptors(t *testing.T) {
	// Not parallel: it lowers this process's descriptor limit for a moment.
	logged := make(chan string, 100)
	log := slog.New(slog.NewTextHandler(chanWriter(logged), nil))
	s, err := Listen(filepath.Join(t.TempDir(), "vol"+Ext), log)
	if err != nil {
		t.Fatal(err)
	}
	s.Register("echo", echo)
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	defer func() {
		s.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()

	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	low := lim
	low.Cur = uint64(highestFD(t) + 3)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer restore()
	// Every descriptor below the limit taken, but one for the caller's socket: the
	// server has none left for its end.
	var fill []*os.File
	defer func() {
		for _, f := range fill {
			f.Close()
		}
	}()
	for {
		f, err := os.Open(os.DevNull)
		if errors.Is(err, syscall.EMFILE) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		fill = append(fill, f)
	}
	if len(fill) == 0 {
		t.Fatal("no descriptor to free for the caller")
	}
	fill[len(fill)-1].Close()
	fill = fill[:len(fill)-1]
	c, err := net.Dial("unix", s.Path())
	if err != nil {
		restore()
		t.Fatalf("dial with one descriptor free: %v", err)
	}
	defer c.Close()
	select {
	case err := <-done:
		done <- nil // for the deferred Close
		restore()
		t.Fatalf("Serve gave up when it could not accept a connection: %v", err)
	case line := <-logged:
		if !strings.Contains(line, "too many open files") {
			t.Errorf("the server logged %q, want the accept's failure", line)
		}
	case <-time.After(30 * time.Second): // a hang guard
		t.Fatal("the server neither accepted nor said why not")
	}
	restore()
	for _, f := range fill {
		f.Close()
	}
	fill = nil
	c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var r echoResult
	if err := Call(ctx, s.Path(), "echo", echoArgs{Word: "back"}, nil, &r); err != nil || r.Word != "back" {
		t.Errorf("once descriptors are free again: %+v, %v", r, err)
	}
}

// highestFD is the highest descriptor this process has open.
func highestFD(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	hi := 0
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			hi = max(hi, n)
		}
	}
	return hi
}

// chanWriter sends each line written to it on a channel, dropping lines when it is full.
type chanWriter chan string

func (w chanWriter) Write(b []byte) (int, error) {
	select {
	case w <- string(b):
	default:
	}
	return len(b), nil
}

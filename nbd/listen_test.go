package nbd

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

func TestListenUnixMode(t *testing.T) {
	t.Parallel()
	// A permissive umask must not widen the socket: the mode comes from the code, not
	// from the process's umask. (The umask is process-wide, so this test only reads it.)
	path := filepath.Join(shortTempDir(t), "s.sock")
	l, err := ListenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != fs.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want socket 0600", fi.Mode())
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("listen left %d entries in the directory, want just the socket", len(entries))
	}
	if l.Addr().String() != path {
		t.Errorf("Addr %q, want %q", l.Addr(), path)
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	c.Close()
	l.Close()
	if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("socket still there after Close: %v", err)
	}
}

func TestListenUnixExisting(t *testing.T) {
	t.Parallel()
	t.Run("stale socket is replaced", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(shortTempDir(t), "s")
		// A socket file nobody listens on, as a killed server leaves behind.
		fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: path}); err != nil {
			t.Fatal(err)
		}
		syscall.Close(fd)
		l, err := ListenUnix(path)
		if err != nil {
			t.Fatalf("stale socket not replaced: %v", err)
		}
		defer l.Close()
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
	})
	t.Run("live socket is refused", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(shortTempDir(t), "s")
		live, err := ListenUnix(path)
		if err != nil {
			t.Fatal(err)
		}
		defer live.Close()
		if _, err := ListenUnix(path); !errors.Is(err, ErrSocketInUse) {
			t.Fatalf("second listen: %v, want ErrSocketInUse", err)
		}
		// The live one still works.
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatalf("live socket broken: %v", err)
		}
		c.Close()
	})
	t.Run("regular file is left alone", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(shortTempDir(t), "s")
		if err := os.WriteFile(path, []byte("precious"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := ListenUnix(path); err == nil {
			t.Fatal("listen replaced a regular file")
		}
		if b, _ := os.ReadFile(path); string(b) != "precious" {
			t.Fatal("regular file changed")
		}
	})
	t.Run("close leaves a newer socket alone", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(shortTempDir(t), "s")
		old, err := ListenUnix(path)
		if err != nil {
			t.Fatal(err)
		}
		// Someone removed our socket and a new server took the path.
		os.Remove(path)
		newer, err := ListenUnix(path)
		if err != nil {
			t.Fatal(err)
		}
		defer newer.Close()
		old.Close()
		if _, err := os.Lstat(path); err != nil {
			t.Fatalf("closing the old listener removed the new socket: %v", err)
		}
	})
}

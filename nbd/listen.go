package nbd

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// ErrSocketInUse is returned by ListenUnix when a live server accepts on the path.
var ErrSocketInUse = errors.New("nbd: a server is already listening on the socket")

// ListenUnix listens on a unix socket at path with mode 0600.
//
// The socket is bound inside a fresh 0700 directory next to path, set to 0600 there and
// then hard-linked into place, so it never exists at path with wider permissions (a umask
// change would be process-wide, and chmod after bind leaves a window). A socket file left
// at path by a dead server is replaced; one that a live server accepts on is left alone
// and ErrSocketInUse returned; anything else at path is an error. Closing the listener
// removes path if it is still this listener's socket.
func ListenUnix(path string) (net.Listener, error) {
	if err := clearStaleSocket(path); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(filepath.Dir(path), ".nbd-")
	if err != nil {
		return nil, fmt.Errorf("nbd: listen on %s: %w", path, err)
	}
	defer os.RemoveAll(dir)
	tmp := filepath.Join(dir, "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("nbd: listen on %s: %w", path, err)
	}
	// The bound name goes away with dir; path is removed by unixListener.Close.
	l.SetUnlinkOnClose(false)
	fail := func(err error) (net.Listener, error) {
		l.Close()
		return nil, fmt.Errorf("nbd: listen on %s: %w", path, err)
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(err)
	}
	// link fails if something appeared at path since the check: never replace it.
	if err := os.Link(tmp, path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fail(fmt.Errorf("%w (or another file appeared there)", ErrSocketInUse))
		}
		return fail(err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return fail(err)
	}
	return &unixListener{UnixListener: l, path: path, fi: fi}, nil
}

// clearStaleSocket removes a socket at path that nobody accepts on.
func clearStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("nbd: listen on %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("nbd: listen on %s: the path exists and is not a socket", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return fmt.Errorf("nbd: listen on %s: %w", path, ErrSocketInUse)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		// Not provably dead (a full backlog times out, say): leave it.
		return fmt.Errorf("nbd: listen on %s: cannot tell whether the existing socket is live: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("nbd: listen on %s: remove stale socket: %w", path, err)
	}
	return nil
}

type unixListener struct {
	*net.UnixListener
	path string
	fi   os.FileInfo
	once sync.Once
}

func (l *unixListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	l.once.Do(func() {
		// Remove path only while it is still our socket, not one a later server put there.
		if fi, e := os.Lstat(l.path); e == nil && os.SameFile(fi, l.fi) {
			os.Remove(l.path)
		}
	})
	return err
}

package volume

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// IDLock is a host-wide exclusive hold on a volume ID, taken by every process that
// writes a volume and kept by its server for as long as it runs.
//
// flock on the provider reaches only the file or device node that was opened: the same
// bytes under another name (a loop device over the image file, a second path to one
// disk, a device-mapper mapping of it) are another inode, so two servers could write one
// volume and wreck it. The volume ID, which every path to the volume reads from its
// header, is the same under all of them. A copy of a volume has the same ID too, and is
// refused beside it: the two would share a witness and mistake each other's generations
// for rollbacks.
//
// The lock is an abstract unix socket (unix(7)) named by the ID: host-wide for every user
// of the network namespace, with no file to leave behind, and the kernel frees the name
// when the last descriptor of its socket closes, so a killed holder never blocks the
// next attach. Its reach ends at the network namespace: processes in other namespaces
// (containers) do not see each other's locks.
type IDLock struct{ f *os.File }

// ErrIDLocked: another process of this host holds the volume ID.
var ErrIDLocked = errors.New("the volume is already open for writing on this host")

// idLockName is the abstract socket address of id's lock, without the leading NUL.
func idLockName(id [16]byte) string { return "eli/volume/" + hex.EncodeToString(id[:]) }

// LockID takes the host-wide lock on a volume ID; it fails at once with ErrIDLocked if
// another process holds it.
func LockID(id [16]byte) (*IDLock, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("volume lock: %w", err)
	}
	// Go spells an abstract address with a leading '@'.
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: "@" + idLockName(id)}); err != nil {
		unix.Close(fd)
		if err == unix.EADDRINUSE {
			return nil, ErrIDLocked
		}
		return nil, fmt.Errorf("volume lock: %w", err)
	}
	return &IDLock{f: os.NewFile(uintptr(fd), "volume-lock")}, nil
}

// IDLockFromFile adopts a lock inherited from the process that took it (the background
// server's); it returns nil if f is not such a lock.
func IDLockFromFile(f *os.File) *IDLock {
	sa, err := unix.Getsockname(int(f.Fd()))
	if u, ok := sa.(*unix.SockaddrUnix); err != nil || !ok || len(u.Name) < 2 || u.Name[0] != '@' {
		f.Close()
		return nil
	}
	return &IDLock{f: f}
}

// File is the lock's socket, for a child process to inherit.
func (l *IDLock) File() *os.File { return l.f }

// Close lets go of this process's hold; the ID is free once no process holds the
// socket.
func (l *IDLock) Close() {
	if l != nil {
		l.f.Close()
	}
}

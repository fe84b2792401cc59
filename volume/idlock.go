package volume

import (
	"bufio"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

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

// IDHeldError is ErrIDLocked with the process that holds the lock, where it could be
// found.
type IDHeldError struct {
	PID  int    // 0 if the holder could not be found
	Comm string // its command name
}

func (e *IDHeldError) Error() string {
	if e.PID == 0 {
		return ErrIDLocked.Error()
	}
	return fmt.Sprintf("%v by pid %d (%s)", ErrIDLocked, e.PID, e.Comm)
}

func (e *IDHeldError) Is(target error) bool { return target == ErrIDLocked }

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
			pid, comm := idLockHolder(id)
			return nil, &IDHeldError{PID: pid, Comm: comm}
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

// idLockHolder finds a process that holds id's lock, as ss -xp would: the socket's inode
// in /proc/net/unix, then a process with a descriptor on it. It sees only the
// descriptors this process may read (all of them as root); pid is 0 where it finds none.
func idLockHolder(id [16]byte) (pid int, comm string) {
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return 0, ""
	}
	defer f.Close()
	want, inode := "@"+idLockName(id), ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// Num RefCount Protocol Flags Type St Inode Path
		if fields := strings.Fields(sc.Text()); len(fields) == 8 && fields[7] == want {
			inode = fields[6]
			break
		}
	}
	if inode == "" {
		return 0, ""
	}
	link := "socket:[" + inode + "]"
	fds, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err != nil || l != link {
			continue
		}
		dir := filepath.Dir(filepath.Dir(fd))
		if pid, err = strconv.Atoi(filepath.Base(dir)); err != nil {
			continue
		}
		c, _ := os.ReadFile(filepath.Join(dir, "comm"))
		return pid, strings.TrimSpace(string(c))
	}
	return 0, ""
}

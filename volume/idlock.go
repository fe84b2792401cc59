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

// idLock is a host-wide hold on a volume ID: exclusive for every process that writes
// the volume, shared for those that serve it read-only, and kept by a server for as long
// as it runs.
//
// flock on the provider reaches only the file or device node that was opened: the same
// bytes under another name (a loop device over the image file, a second path to one
// disk, a device-mapper mapping of it) are another inode, so two servers could write one
// volume and wreck it, or one could serve stale data read-only while another writes it.
// The volume ID, which every path to the volume reads from its header, is the same under
// all of them. A copy of a volume has the same ID too, and is refused beside it: the two
// would share a witness and mistake each other's generations for rollbacks.
//
// The lock is made of abstract unix sockets (unix(7)) named by the ID: host-wide for
// every user of the network namespace, with no file to leave behind, and the kernel
// frees a name when the last descriptor of its socket closes, so a killed holder never
// blocks the next attach. A writer binds the ID's name; a reader binds one of
// maxReaders reader names. Each then looks for the other kind (a connect to a name
// nobody bound is refused), after binding its own, so that of two that race at least
// one sees the other. A server that is ready binds one more name, the ID's serving
// name, so that a contender can tell a volume being served (refused at once) from a
// command that is still at work on it (which may finish or fail: OpenProvider waits).
// Its reach ends at the network namespace: processes in other namespaces (containers)
// do not see each other's locks.
type idLock struct {
	id      [16]byte
	f       *os.File // bound to the writer's or a reader's name
	serving *os.File // bound to the serving name, once MarkServing
	shared  bool
}

// maxReaders bounds the read-only holders of one volume on a host.
const maxReaders = 64

// ErrIDLocked: another process of this host holds the volume ID.
var ErrIDLocked = errors.New("the volume is already open for writing on this host")

// IDHeldError is ErrIDLocked with who holds the lock, as far as it could be found.
type IDHeldError struct {
	ID       [16]byte
	ReadOnly bool   // the holder serves it read-only (a writer was refused)
	Serving  bool   // the holder is a server that is ready, not a command at work
	PID      int    // 0 if the holder could not be found
	Comm     string // its command name
}

func (e *IDHeldError) Error() string {
	what := ErrIDLocked.Error()
	if e.ReadOnly {
		what = "the volume is open read-only on this host"
	}
	switch {
	case e.PID != 0 && e.Serving:
		return fmt.Sprintf("%s: served by pid %d (%s)", what, e.PID, e.Comm)
	case e.PID != 0:
		return fmt.Sprintf("%s by pid %d (%s)", what, e.PID, e.Comm)
	}
	return what
}

func (e *IDHeldError) Is(target error) bool { return target == ErrIDLocked }

// idLockName is the abstract socket address of id's writer lock, without the leading
// NUL; readerName and servingName derive from it.
func idLockName(id [16]byte) string        { return "eli/volume/" + hex.EncodeToString(id[:]) }
func readerName(id [16]byte, k int) string { return idLockName(id) + "/ro/" + strconv.Itoa(k) }
func servingName(id [16]byte) string       { return idLockName(id) + "/serving" }

// bind binds a new datagram socket to the abstract name; ok false if another holds it.
func bind(name string) (f *os.File, ok bool, err error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, false, fmt.Errorf("volume lock: %w", err)
	}
	// Go spells an abstract address with a leading '@'.
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: "@" + name}); err != nil {
		unix.Close(fd)
		if err == unix.EADDRINUSE {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("volume lock: %w", err)
	}
	return os.NewFile(uintptr(fd), "volume-lock"), true, nil
}

// bound reports whether a socket holds the abstract name: a datagram connect to a name
// nobody bound is refused. Any other answer counts as bound, which errs on the side of
// refusing.
func bound(name string) bool {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return true
	}
	defer unix.Close(fd)
	return unix.Connect(fd, &unix.SockaddrUnix{Name: "@" + name}) != unix.ECONNREFUSED
}

// lockVolumeID takes the exclusive host-wide lock on a volume ID, for a writer; it fails at
// once with an *IDHeldError if a writer or a reader holds it.
func lockVolumeID(id [16]byte) (*idLock, error) {
	f, ok, err := bind(idLockName(id))
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, held(id, idLockName(id), false)
	}
	for k := range maxReaders {
		if name := readerName(id, k); bound(name) {
			f.Close()
			return nil, held(id, name, true)
		}
	}
	return &idLock{id: id, f: f}, nil
}

// lockVolumeIDShared takes a shared hold on a volume ID, for a reader: any number of readers
// (up to maxReaders) share it, and it fails at once with an *IDHeldError while a writer
// holds the ID.
func lockVolumeIDShared(id [16]byte) (*idLock, error) {
	var f *os.File
	for k := 0; f == nil; k++ {
		if k == maxReaders {
			return nil, fmt.Errorf("volume lock: %d read-only users of the volume on this host already", maxReaders)
		}
		var ok bool
		var err error
		if f, ok, err = bind(readerName(id, k)); err != nil {
			return nil, err
		} else if !ok {
			f = nil
		}
	}
	if bound(idLockName(id)) {
		f.Close()
		return nil, held(id, idLockName(id), false)
	}
	return &idLock{id: id, f: f, shared: true}, nil
}

// held describes who holds name, a lock of id.
func held(id [16]byte, name string, readOnly bool) *IDHeldError {
	e := &IDHeldError{ID: id, ReadOnly: readOnly, Serving: readOnly || bound(servingName(id))}
	e.PID, e.Comm = lockHolder(name, !readOnly)
	return e
}

// MarkServing says that the holder is a server that is ready: contenders are refused at
// once rather than waiting for it to finish (a reader's hold says so by itself).
func (l *idLock) MarkServing() error {
	if l == nil || l.shared || l.serving != nil {
		return nil
	}
	f, ok, err := bind(servingName(l.id))
	if err != nil {
		return err
	}
	if ok {
		l.serving = f
	}
	return nil
}

// Shared reports whether this is a reader's hold.
func (l *idLock) Shared() bool { return l.shared }

// adoptIDLock adopts a lock inherited from the process that took it (the background
// server's); it returns nil if f is not such a lock.
func adoptIDLock(f *os.File, id [16]byte) *idLock {
	sa, err := unix.Getsockname(int(f.Fd()))
	u, ok := sa.(*unix.SockaddrUnix)
	if err != nil || !ok || !strings.HasPrefix(u.Name, "@"+idLockName(id)) {
		f.Close()
		return nil
	}
	return &idLock{id: id, f: f, shared: u.Name != "@"+idLockName(id)}
}

// File is the lock's socket, for a child process to inherit.
func (l *idLock) File() *os.File { return l.f }

// Close lets go of this process's hold; the ID is free once no process holds the
// socket.
func (l *idLock) Close() {
	if l == nil {
		return
	}
	if l.serving != nil {
		l.serving.Close()
	}
	l.f.Close()
}

// lockHolder finds a process that holds the abstract socket name, as ss -xp would: the
// socket's inode in /proc/net/unix, then a process with a descriptor on it; with
// preferServer, one that runs eli's server ("__serve") rather than the command that
// started it, which lets go of it once the server is ready. It sees only the
// descriptors this process may read (all of them as root); pid is 0 where it finds none.
func lockHolder(name string, preferServer bool) (pid int, comm string) {
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return 0, ""
	}
	defer f.Close()
	want, inode := "@"+name, ""
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
		p, err := strconv.Atoi(filepath.Base(dir))
		if err != nil || p == pid {
			continue
		}
		c, _ := os.ReadFile(filepath.Join(dir, "comm"))
		if pid == 0 {
			pid, comm = p, strings.TrimSpace(string(c))
		}
		if !preferServer {
			break
		}
		if args, _ := os.ReadFile(filepath.Join(dir, "cmdline")); strings.Contains(string(args), "\x00__serve") {
			return p, strings.TrimSpace(string(c))
		}
	}
	return pid, comm
}

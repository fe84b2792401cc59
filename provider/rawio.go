package provider

import (
	"errors"
	"io"
	"os"
	"sync"
	"syscall"
	"unsafe"
)

// rawFile reads, writes and syncs a file on tmpfs with raw system calls, which the Go
// runtime is not told of. On tmpfs a read or write is a copy between memory and memory
// and a sync does nothing: none waits for a disk. Told of each call, the runtime takes
// the thread's processor away from one that lasts past its monitor's next tick (20 µs:
// a 256 KiB write does) and wakes its monitor thread whenever one starts while the
// process was idle; the monitor then polls every 20 µs for a millisecond or more, and on
// a VM each of its sleeps costs a hypervisor exit. Reads and writes are cut into pieces
// of rawPiece, so that one never holds its processor much longer than the runtime lets
// a goroutine run unchecked anyway. (Where tmpfs must first reclaim memory, or bring a
// page back from swap, a call may sleep while it holds its processor: the other
// processors go on.) nbd's rawConn does the same for the socket; docs/benchmarks.md
// ("Measurements behind design choices") has what the two saved.
type rawFile struct {
	rc   syscall.RawConn
	path string
	ops  sync.Pool // of *rawOp, each with its callback bound once
}

const rawPiece = 1 << 20

func newRawFile(rc syscall.RawConn, path string) *rawFile {
	f := &rawFile{rc: rc, path: path}
	f.ops.New = func() any {
		op := new(rawOp)
		op.fn = op.do
		return op
	}
	return f
}

// WriteAt has os.File.WriteAt's contract: all of b is written, or an error says why not.
func (f *rawFile) WriteAt(b []byte, off int64) (int, error) {
	return f.run(syscall.SYS_PWRITE64, "write", b, off)
}

// ReadAt has os.File.ReadAt's contract: b is filled, or an error says why not (io.EOF
// at the end of the file).
func (f *rawFile) ReadAt(b []byte, off int64) (int, error) {
	return f.run(syscall.SYS_PREAD64, "read", b, off)
}

// Sync is fdatasync.
func (f *rawFile) Sync() error {
	_, err := f.run(syscall.SYS_FDATASYNC, "sync", nil, 0)
	return err
}

func (f *rawFile) run(trap uintptr, name string, b []byte, off int64) (int, error) {
	if off < 0 {
		return 0, &os.PathError{Op: name, Path: f.path, Err: errors.New("negative offset")}
	}
	op := f.ops.Get().(*rawOp)
	op.trap, op.b, op.off, op.n, op.errno, op.eof = trap, b, off, 0, 0, false
	err := f.rc.Control(op.fn) // keeps the descriptor open while op.fn runs
	n, errno, eof := op.n, op.errno, op.eof
	op.b = nil
	f.ops.Put(op)
	switch {
	case err != nil:
	case errno != 0:
		err = errno
	case eof:
		return n, io.EOF
	default:
		return n, nil
	}
	return n, &os.PathError{Op: name, Path: f.path, Err: err}
}

type rawOp struct {
	trap  uintptr
	b     []byte
	off   int64
	n     int
	errno syscall.Errno
	eof   bool
	fn    func(fd uintptr)
}

func (op *rawOp) do(fd uintptr) {
	if op.trap == syscall.SYS_FDATASYNC {
		for {
			if _, _, e := syscall.RawSyscall(syscall.SYS_FDATASYNC, fd, 0, 0); e != syscall.EINTR {
				op.errno = e
				return
			}
		}
	}
	for op.n < len(op.b) {
		piece := op.b[op.n:min(len(op.b), op.n+rawPiece)]
		m, _, e := syscall.RawSyscall6(op.trap, fd, uintptr(unsafe.Pointer(&piece[0])), uintptr(len(piece)), uintptr(op.off+int64(op.n)), 0, 0)
		switch {
		case e == syscall.EINTR:
		case e != 0:
			op.errno = e
			return
		case m == 0 && op.trap == syscall.SYS_PREAD64:
			op.eof = true
			return
		case m == 0:
			op.errno = syscall.EIO // no progress and no error: never loop on it
			return
		default:
			op.n += int(m)
		}
	}
}

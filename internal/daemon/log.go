package daemon

import (
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// MaxLogBytes caps a background server's log: past it NAME.log becomes NAME.log.1
// (replacing the older part) and a new NAME.log begins, so a server that runs for months,
// or logs one line per damaged sector, keeps at most twice this on disk.
const MaxLogBytes = 4 << 20

// RotatingLog is the background server's log writer. The server's standard output and
// error are the log file itself (so that a panic lands there too); RotatingLog writes
// through f and, when the file is full, points f's descriptor and the others in fds at a
// new file.
type RotatingLog struct {
	mu   sync.Mutex
	path string
	f    *os.File
	fds  []int
	size int64
	max  int64
}

// NewRotatingLog writes to f, the file at path, and rotates it past max bytes (MaxLogBytes
// when 0), redirecting f and every descriptor in fds to the new file.
func NewRotatingLog(path string, f *os.File, max int64, fds ...int) *RotatingLog {
	if max <= 0 {
		max = MaxLogBytes
	}
	l := &RotatingLog{path: path, f: f, fds: append([]int{int(f.Fd())}, fds...), max: max}
	if st, err := f.Stat(); err == nil {
		l.size = st.Size()
	}
	return l
}

func (l *RotatingLog) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.size > 0 && l.size+int64(len(b)) > l.max {
		l.rotate()
	}
	n, err := l.f.Write(b)
	l.size += int64(n)
	return n, err
}

// rotate moves the full log aside and starts a new one. If that fails the log goes on
// in the old file and the next write tries again.
func (l *RotatingLog) rotate() {
	if err := os.Rename(l.path, l.path+".1"); err != nil {
		return
	}
	nf, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	defer nf.Close()
	for _, fd := range l.fds {
		unix.Dup3(int(nf.Fd()), fd, 0)
	}
	l.size = 0
}

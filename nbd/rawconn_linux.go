package nbd

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"
)

// rawConn reads and writes a socket with raw system calls, which the Go runtime is not
// told of, and waits for it through the runtime's poller as net.Conn does (so deadlines
// and Close work as before).
//
// The socket is non-blocking, so such a call never sleeps: it copies what the socket
// holds or has room for, at most its buffer's size, and returns. Told of every call, the
// runtime wakes its monitor thread (sysmon) whenever one starts while the server was
// idle, and the monitor then polls every 20 µs for a millisecond or more; on a VM each of
// its sleeps costs a hypervisor exit. With this and provider's raw system calls on tmpfs
// (provider/rawio.go), a copy into eli none wakes the monitor a fraction as often, and
// the server spends less CPU per GB (docs/benchmarks.md, "Measurements behind design
// choices", counted with perf's syscall tracepoints).
type rawConn struct {
	net.Conn
	rc syscall.RawConn
	// The state of the read and the write in progress, and the callbacks bound to
	// them once, so that a call allocates nothing.
	rmu sync.Mutex
	r   rawRead
	wmu sync.Mutex
	w   rawWrite
}

// newRawConn wraps c if it is a socket the runtime polls (TCP, unix); anything else
// (net.Pipe in tests) is returned as it is.
func newRawConn(c net.Conn) net.Conn {
	switch c.(type) {
	case *net.TCPConn, *net.UnixConn:
	default:
		return c
	}
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		return c
	}
	r := &rawConn{Conn: c, rc: rc}
	r.r.fn = r.r.do
	r.w.fn = r.w.do
	return r
}

func (c *rawConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.r.p, c.r.n, c.r.errno = p, 0, 0
	err := c.rc.Read(c.r.fn)
	n, errno := c.r.n, c.r.errno
	c.r.p = nil
	switch {
	case err != nil:
		return 0, err
	case errno != 0:
		return 0, os.NewSyscallError("read", errno)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

type rawRead struct {
	p     []byte
	n     int
	errno syscall.Errno
	fn    func(fd uintptr) bool
}

func (o *rawRead) do(fd uintptr) bool {
	for {
		m, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&o.p[0])), uintptr(len(o.p)))
		switch e {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false // wait for data through the poller
		}
		o.n, o.errno = int(m), e
		return true
	}
}

func (c *rawConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.w.one[0] = p
	n, err := c.writeLocked(c.w.one[:])
	c.w.one[0] = nil
	return int(n), err
}

// WriteBuffers writes every byte of bufs in order, with writev, as net.Buffers does for
// the standard library's connections. It consumes bufs.
func (c *rawConn) WriteBuffers(bufs [][]byte) (int64, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.writeLocked(bufs)
}

func (c *rawConn) writeLocked(bufs [][]byte) (int64, error) {
	c.w.bufs, c.w.done, c.w.errno = bufs, 0, 0
	err := c.rc.Write(c.w.fn)
	done, errno := c.w.done, c.w.errno
	c.w.bufs = nil
	clear(c.w.iov[:])
	switch {
	case err != nil:
		return done, err
	case errno != 0:
		return done, os.NewSyscallError("writev", errno)
	}
	return done, nil
}

type rawWrite struct {
	bufs  [][]byte
	one   [1][]byte
	iov   [8]syscall.Iovec
	done  int64
	errno syscall.Errno
	fn    func(fd uintptr) bool
}

func (o *rawWrite) do(fd uintptr) bool {
	for {
		k := 0
		for _, b := range o.bufs {
			if k == len(o.iov) {
				break
			}
			if len(b) > 0 {
				o.iov[k].Base = &b[0]
				o.iov[k].SetLen(len(b))
				k++
			}
		}
		if k == 0 {
			return true
		}
		m, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&o.iov[0])), uintptr(k))
		switch e {
		case 0:
			if m == 0 {
				o.errno = syscall.EIO // no progress and no error: never loop on it
				return true
			}
			o.done += int64(m)
			o.bufs = consume(o.bufs, int64(m))
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false // wait for room through the poller
		default:
			o.errno = e
			return true
		}
	}
}

// consume drops the first n bytes of bufs.
func consume(bufs [][]byte, n int64) [][]byte {
	for len(bufs) > 0 {
		l := int64(len(bufs[0]))
		if l > n {
			bufs[0] = bufs[0][n:]
			return bufs
		}
		n -= l
		bufs = bufs[1:]
	}
	return bufs
}

package nbdkernel

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The kernel's NBD driver gives up on a server in two ways that a server which holds
// requests for a while (eli's suspend) must both defer. The facts are from Linux 6.1's
// drivers/block/nbd.c and block/ (Debian's linux-source-6.1, the kernel of the VM tests),
// and on that kernel TestVMSuspend shows eli's suspend deferring both (raising the
// request timeout alone fails the I/O through the send timeout: "Send data failed
// (result -11)", then EIO once the dead-connection timeout has passed):
//
//   - The request timeout. A request not answered within the device's timeout goes to
//     nbd_xmit_timeout: with more than one connection, or one connection and a non-zero
//     timeout, its socket is marked dead (shut down) and the request requeued on another
//     one; once all are dead, requests wait dead_conn_timeout for a re-plug and then fail
//     with EIO. A timeout of 0 re-arms the timer instead ("Possible stuck request"), but
//     only for a device with one connection, and the queue's timer still runs at 30 s: it
//     is no way out for a multi-connection device. NBD_CMD_RECONFIGURE's NBD_ATTR_TIMEOUT
//     sets the timeout live (nbd_set_cmd_timeout: tag_set.timeout and the queue's
//     rq_timeout).
//   - The send timeout. The driver writes each request into its socket under the socket's
//     SO_SNDTIMEO, which it sets to the timeout when a socket is connected or re-plugged
//     and never again: a reconfigured timeout does not reach it. When the server stops
//     reading (its own limit on requests in flight, or a stopped process), a request
//     larger than what the socket buffers take blocks in sendmsg, fails with EAGAIN when
//     the send timeout expires ("Send data failed"), and its socket is marked dead as
//     above. Only a holder of the socket's file can change it.
//   - Requests already in flight. A request takes the queue's rq_timeout when it is
//     started (blk_add_timer; blk_mq_rq_ctx_init zeroes it) and keeps it through re-arms
//     and requeues: a raised timeout applies to requests started afterwards. (A VM run
//     showed a read started before the raise timed out at 30 s, requeued, and again 30 s
//     later. While a send is blocked, though, no request of the device is timed out at
//     all: nbd's queue is BLK_MQ_F_BLOCKING, and the timeout work first waits for every
//     running queue_rq, synchronize_srcu in blk_mq_wait_quiesce_done.)
//
// So a server that is about to hold requests raises both (Device.SetTimeout), keeps
// answering until every request started before the raise has its reply, then holds; and
// restores both when it answers again.

// DefaultTimeout is the request timeout eli connects a device with: a server that does not
// answer for this long is treated as dead by the kernel, which then fails the I/O after the
// dead-connection timeout unless a new server is plugged in.
const DefaultTimeout = 30 * time.Second

// MaxTimeout bounds SetTimeout. The kernel keeps the timeout in jiffies in 32-bit fields
// (tag_set.timeout, the queue's rq_timeout, each request's timeout): seconds × HZ must
// fit, which 30 days does for any HZ up to 1000.
const MaxTimeout = 30 * 24 * time.Hour

// Device is a connected /dev/nbdN as the server that connected it sees it: its index, the
// backend it was connected with (the kernel refuses to reconfigure a device with a backend
// unless it is named), and duplicates of the kernel's ends of its sockets, kept so that
// their send timeout can be changed. A Device is not safe for concurrent use.
type Device struct {
	index   int
	backend string
	socks   []*os.File
	// execute sends a generic netlink command; tests replace it.
	execute func(cmd uint8, attrs []byte) error
}

// NewDevice returns the Device for /dev/nbd<index>, connected (Connect, Attach or
// Reconfigure) for backend with socks. It keeps duplicates of socks, so the caller closes
// its own files as before; Close releases the duplicates.
func NewDevice(index int, backend string, socks []*os.File) (*Device, error) {
	if index < 0 {
		return nil, errors.New("nbdkernel: a device needs an index")
	}
	if len(socks) == 0 {
		return nil, errors.New("nbdkernel: a device needs the sockets it was connected with")
	}
	d := &Device{index: index, backend: backend, execute: executeAck}
	for _, f := range socks {
		fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			d.Close()
			return nil, fmt.Errorf("keep the sockets of /dev/nbd%d: %w", index, err)
		}
		d.socks = append(d.socks, os.NewFile(uintptr(fd), f.Name()))
	}
	return d, nil
}

func executeAck(cmd uint8, attrs []byte) error {
	_, err := execute(cmd, attrs)
	return err
}

// Index is N in /dev/nbdN.
func (d *Device) Index() int { return d.index }

// SetTimeout sets how long the kernel waits for the server before it treats a connection
// as dead: the timeout of every request the kernel starts from now on (NBD_CMD_RECONFIGURE
// with NBD_ATTR_TIMEOUT), and the send timeout of every socket. t is rounded up to whole
// seconds and must be within [1 s, MaxTimeout]; DefaultTimeout restores what eli connects
// with. Requests already in flight keep the timeout they started with (see the comment at
// the top of this file): a server raises the timeout before it stops answering.
//
// The sockets are changed first: if the netlink command fails, the request timeout is
// unchanged and the error says so; calling SetTimeout again (or with the old value) puts
// both in step.
func (d *Device) SetTimeout(t time.Duration) error {
	secs, err := timeoutSeconds(t)
	if err != nil {
		return err
	}
	tv := unix.Timeval{Sec: int64(secs)}
	for i, f := range d.socks {
		if err := unix.SetsockoptTimeval(int(f.Fd()), unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv); err != nil {
			return fmt.Errorf("set the send timeout of /dev/nbd%d's socket %d to %d s: %w", d.index, i, secs, err)
		}
	}
	if err := setRequestTimeout(d.execute, d.index, d.backend, secs); err != nil {
		return fmt.Errorf("%w (its sockets' send timeout is set)", err)
	}
	return nil
}

// SetRequestTimeout changes only the request timeout of /dev/nbd<index>, connected for
// backend; the sockets keep their send timeout. It is for a process that does not hold the
// device's sockets: a server that does uses Device.SetTimeout, since a server that stops
// reading its sockets needs both.
func SetRequestTimeout(index int, backend string, t time.Duration) error {
	secs, err := timeoutSeconds(t)
	if err != nil {
		return err
	}
	return setRequestTimeout(executeAck, index, backend, secs)
}

func setRequestTimeout(execute func(uint8, []byte) error, index int, backend string, secs uint64) error {
	attrs, err := timeoutAttrs(index, backend, secs)
	if err != nil {
		return err
	}
	if err := execute(cmdReconfigure, attrs); err != nil {
		return fmt.Errorf("set the request timeout of /dev/nbd%d to %d s: %w", index, secs, err)
	}
	return nil
}

// SendTimeouts reports each kept socket's send timeout as the kernel now has it
// (SO_SNDTIMEO; 0 means none), for checks and diagnostics.
func (d *Device) SendTimeouts() ([]time.Duration, error) {
	out := make([]time.Duration, len(d.socks))
	for i, f := range d.socks {
		tv, err := unix.GetsockoptTimeval(int(f.Fd()), unix.SOL_SOCKET, unix.SO_SNDTIMEO)
		if err != nil {
			return nil, fmt.Errorf("read the send timeout of /dev/nbd%d's socket %d: %w", d.index, i, err)
		}
		out[i] = time.Duration(tv.Sec)*time.Second + time.Duration(tv.Usec)*time.Microsecond
	}
	return out, nil
}

// Close releases the Device's duplicates of the sockets; the device itself stays
// connected (Disconnect ends it).
func (d *Device) Close() error {
	var errs []error
	for _, f := range d.socks {
		errs = append(errs, f.Close())
	}
	d.socks = nil
	return errors.Join(errs...)
}

// timeoutSeconds rounds t up to whole seconds within [1, MaxTimeout].
func timeoutSeconds(t time.Duration) (uint64, error) {
	if t <= 0 || t > MaxTimeout {
		return 0, fmt.Errorf("nbdkernel: timeout %v is out of range (want 1s to %v)", t, MaxTimeout)
	}
	return uint64((t + time.Second - 1) / time.Second), nil
}

// timeoutAttrs encodes an NBD_CMD_RECONFIGURE that changes only the timeout: no size (the
// kernel then leaves the geometry alone), no sockets, no flags.
func timeoutAttrs(index int, backend string, secs uint64) ([]byte, error) {
	if index < 0 {
		return nil, errors.New("nbdkernel: reconfigure needs a device index")
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	ae.Uint64(attrTimeout, secs)
	if backend != "" {
		ae.String(attrBackend, backend)
	}
	return ae.Encode()
}

// RequestTimeout is the request timeout the kernel now gives new requests of
// /dev/nbd<idx> (the queue's io_timeout in sysfs), for checks and diagnostics.
func RequestTimeout(idx int) (time.Duration, error) { return realHost.requestTimeout(idx) }

func (h host) requestTimeout(idx int) (time.Duration, error) {
	s, err := h.readAttr(idx, "queue/io_timeout")
	if err != nil {
		return 0, err
	}
	ms, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("/dev/nbd%d: io_timeout %q: %w", idx, s, err)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

// InFlight is the number of requests of /dev/nbd<idx> that the block layer has issued and
// not completed (sysfs inflight: reads and writes). A server that raised the timeouts
// waits for it to be 0 once before it holds requests: every request started before the
// raise has then been answered.
func InFlight(idx int) (int, error) { return realHost.inFlight(idx) }

func (h host) inFlight(idx int) (int, error) {
	s, err := h.readAttr(idx, "inflight")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(s)
	if len(f) != 2 {
		return 0, fmt.Errorf("/dev/nbd%d: inflight %q: want reads and writes", idx, s)
	}
	n := 0
	for _, v := range f {
		k, err := strconv.ParseUint(v, 10, 31)
		if err != nil {
			return 0, fmt.Errorf("/dev/nbd%d: inflight %q: %w", idx, s, err)
		}
		n += int(k)
	}
	return n, nil
}

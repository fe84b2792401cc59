package nbdclient

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"syscall"

	"github.com/elidisk/eli/internal/nbdproto"
)

const (
	maxOptReply = 64 << 10
	// MaxRequest is the largest payload this client sends or accepts in one request.
	MaxRequest = 32 << 20
)

// Transmission flags the server advertises (NBD_FLAG_*).
const (
	FlagHasFlags        = nbdproto.TflagHasFlags
	FlagReadOnly        = nbdproto.TflagReadOnly
	FlagSendFlush       = nbdproto.TflagSendFlush
	FlagSendFUA         = nbdproto.TflagSendFUA
	FlagRotational      = nbdproto.TflagRotational
	FlagSendTrim        = nbdproto.TflagSendTrim
	FlagSendWriteZeroes = nbdproto.TflagSendWriteZeroes
	FlagCanMultiConn    = nbdproto.TflagCanMultiConn
)

// Export describes what the server said about the export during NBD_OPT_GO.
type Export struct {
	Size           uint64
	Flags          uint16
	MinBlock       uint32
	PreferredBlock uint32
	MaxBlock       uint32
}

// Client is one negotiated connection with simple replies and one request at a time. It
// is not safe for concurrent use. eli uses it where a socket is handed to the kernel's
// NBD driver once negotiated, and in tests; Remote is the client for real workloads.
type Client struct {
	conn   net.Conn
	Export Export
	handle uint64
	hdr    [32]byte
}

// Dial connects to a unix socket (network "unix") or TCP address and negotiates export name.
func Dial(network, addr, name string) (*Client, error) {
	conn, err := net.Dial(network, addr)
	if err != nil {
		return nil, fmt.Errorf("connect to NBD server: %w", err)
	}
	c, err := Handshake(conn, name)
	if err != nil {
		conn.Close()
		return nil, err
	}
	return c, nil
}

// Handshake negotiates export name on an open connection (fixed newstyle, NBD_OPT_GO,
// simple replies, so that the socket can be handed to the kernel's NBD driver, which
// speaks nothing else). On success the connection is in the transmission phase.
func Handshake(conn net.Conn, name string) (*Client, error) {
	n, err := negotiate(context.Background(), conn, handshakeConfig{name: name})
	if err != nil {
		return nil, err
	}
	return &Client{conn: n.conn, Export: n.export}, nil
}

// Conn returns the underlying connection, e.g. to hand it to the kernel once negotiated.
func (c *Client) Conn() net.Conn { return c.conn }

// Error is an error reply from the server.
type Error struct {
	Op    string
	Errno syscall.Errno
	Msg   string // the server's message, from a structured error chunk
}

func (e *Error) Error() string {
	if e.Msg != "" {
		return fmt.Sprintf("nbd %s: server replied %v: %s", e.Op, e.Errno, e.Msg)
	}
	return fmt.Sprintf("nbd %s: server replied %v", e.Op, e.Errno)
}
func (e *Error) Unwrap() error { return e.Errno }

// nbdErrno maps NBD error values (which are Linux errno numbers) to syscall.Errno.
func nbdErrno(v uint32) syscall.Errno {
	switch v {
	case nbdproto.EPerm, nbdproto.EIO, nbdproto.ENoMem, nbdproto.EInval, nbdproto.ENoSpc,
		nbdproto.EOverflow, nbdproto.ENotSup, nbdproto.EShutdown:
		return syscall.Errno(v)
	}
	return syscall.EIO
}

func (c *Client) request(op string, cmd, flags uint16, off uint64, length uint32, payload, readInto []byte) error {
	c.handle++
	h := c.hdr[:28]
	putRequest(h, flags, cmd, c.handle, off, length)
	if _, err := c.conn.Write(h); err != nil {
		return fmt.Errorf("nbd %s: %w", op, err)
	}
	if len(payload) > 0 {
		if _, err := c.conn.Write(payload); err != nil {
			return fmt.Errorf("nbd %s: %w", op, err)
		}
	}
	r := c.hdr[:16]
	if _, err := io.ReadFull(c.conn, r); err != nil {
		return fmt.Errorf("nbd %s: read reply: %w", op, err)
	}
	if binary.BigEndian.Uint32(r[0:]) != nbdproto.MagicSimpleReply {
		return fmt.Errorf("nbd %s: bad reply magic %#x", op, binary.BigEndian.Uint32(r[0:]))
	}
	if got := binary.BigEndian.Uint64(r[8:]); got != c.handle {
		return fmt.Errorf("nbd %s: reply for handle %d, expected %d", op, got, c.handle)
	}
	if e := binary.BigEndian.Uint32(r[4:]); e != 0 {
		return &Error{Op: op, Errno: nbdErrno(e)}
	}
	if readInto != nil {
		if _, err := io.ReadFull(c.conn, readInto); err != nil {
			return fmt.Errorf("nbd %s: read data: %w", op, err)
		}
	}
	return nil
}

func checkLen(n int) error {
	if n > MaxRequest {
		return fmt.Errorf("nbd: request of %d bytes exceeds %d", n, MaxRequest)
	}
	return nil
}

// ReadAt reads len(p) bytes at off.
func (c *Client) ReadAt(p []byte, off int64) error {
	if err := checkLen(len(p)); err != nil {
		return err
	}
	return c.request("read", nbdproto.CmdRead, 0, uint64(off), uint32(len(p)), nil, p)
}

// WriteAt writes p at off, durably before replying if fua.
func (c *Client) WriteAt(p []byte, off int64, fua bool) error {
	if err := checkLen(len(p)); err != nil {
		return err
	}
	var fl uint16
	if fua {
		fl = nbdproto.CmdFlagFUA
	}
	return c.request("write", nbdproto.CmdWrite, fl, uint64(off), uint32(len(p)), p, nil)
}

// Flush asks the server to make completed writes durable.
func (c *Client) Flush() error { return c.request("flush", nbdproto.CmdFlush, 0, 0, 0, nil, nil) }

// Trim discards [off, off+length).
func (c *Client) Trim(off int64, length uint32) error {
	return c.request("trim", nbdproto.CmdTrim, 0, uint64(off), length, nil, nil)
}

// WriteZeroes zeroes [off, off+length).
func (c *Client) WriteZeroes(off int64, length uint32) error {
	return c.request("write-zeroes", nbdproto.CmdWriteZeroes, 0, uint64(off), length, nil, nil)
}

// Close sends NBD_CMD_DISC (which has no reply) and closes the connection.
func (c *Client) Close() error {
	c.handle++
	h := c.hdr[:28]
	putRequest(h, 0, nbdproto.CmdDisc, c.handle, 0, 0)
	_, werr := c.conn.Write(h)
	cerr := c.conn.Close()
	if werr != nil {
		return werr
	}
	return cerr
}

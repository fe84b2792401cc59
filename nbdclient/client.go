// Package nbdclient is a minimal NBD client: the fixed newstyle handshake with
// NBD_OPT_GO, then one request at a time with simple replies. eli uses it where no
// external client can be assumed: `eli demo`, handing a negotiated socket to the kernel's
// NBD driver, and tests. It is deliberately small; real workloads use real clients
// (the kernel, libnbd, qemu).
package nbdclient

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"

	"github.com/elidisk/eli/nbd/nbdproto"
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

// Client is one negotiated connection. It is not safe for concurrent use.
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

// Handshake negotiates export name on an open connection (fixed newstyle, NBD_OPT_GO).
// On success the connection is in the transmission phase.
func Handshake(conn net.Conn, name string) (*Client, error) {
	if len(name) > 4096 {
		return nil, errors.New("nbd: export name longer than 4096 bytes")
	}
	var greet [18]byte
	if _, err := io.ReadFull(conn, greet[:]); err != nil {
		return nil, fmt.Errorf("nbd handshake: read greeting: %w", err)
	}
	if binary.BigEndian.Uint64(greet[0:]) != nbdproto.MagicNBD || binary.BigEndian.Uint64(greet[8:]) != nbdproto.MagicOpt {
		return nil, errors.New("nbd handshake: server is not a newstyle NBD server")
	}
	hflags := binary.BigEndian.Uint16(greet[16:])
	if hflags&nbdproto.FlagFixedNewstyle == 0 {
		return nil, errors.New("nbd handshake: server does not support fixed newstyle")
	}
	cflags := uint32(nbdproto.FlagCFixedNewstyle)
	if hflags&nbdproto.FlagNoZeroes != 0 {
		cflags |= nbdproto.FlagCNoZeroes
	}
	if err := binary.Write(conn, binary.BigEndian, cflags); err != nil {
		return nil, fmt.Errorf("nbd handshake: %w", err)
	}

	// NBD_OPT_GO: name, then the one info request we care about beyond the mandatory
	// NBD_INFO_EXPORT.
	data := make([]byte, 0, 4+len(name)+4)
	data = binary.BigEndian.AppendUint32(data, uint32(len(name)))
	data = append(data, name...)
	data = binary.BigEndian.AppendUint16(data, 1)
	data = binary.BigEndian.AppendUint16(data, nbdproto.InfoBlockSize)
	if err := writeOption(conn, nbdproto.OptGo, data); err != nil {
		return nil, err
	}
	c := &Client{conn: conn}
	gotExport := false
	for {
		typ, payload, err := readOptReply(conn, nbdproto.OptGo)
		if err != nil {
			return nil, err
		}
		switch {
		case typ == nbdproto.RepAck:
			if !gotExport {
				return nil, errors.New("nbd handshake: server acknowledged NBD_OPT_GO without NBD_INFO_EXPORT")
			}
			return c, nil
		case typ == nbdproto.RepInfo:
			if len(payload) < 2 {
				return nil, errors.New("nbd handshake: short NBD_REP_INFO")
			}
			switch binary.BigEndian.Uint16(payload) {
			case nbdproto.InfoExport:
				if len(payload) != 12 {
					return nil, errors.New("nbd handshake: bad NBD_INFO_EXPORT length")
				}
				c.Export.Size = binary.BigEndian.Uint64(payload[2:])
				c.Export.Flags = binary.BigEndian.Uint16(payload[10:])
				gotExport = true
			case nbdproto.InfoBlockSize:
				if len(payload) != 14 {
					return nil, errors.New("nbd handshake: bad NBD_INFO_BLOCK_SIZE length")
				}
				c.Export.MinBlock = binary.BigEndian.Uint32(payload[2:])
				c.Export.PreferredBlock = binary.BigEndian.Uint32(payload[6:])
				c.Export.MaxBlock = binary.BigEndian.Uint32(payload[10:])
			}
		case typ&nbdproto.RepFlagError != 0:
			msg := string(payload)
			if msg == "" {
				msg = fmt.Sprintf("error %#x", typ)
			}
			return nil, fmt.Errorf("nbd handshake: server refused export %q: %s", name, msg)
		default:
			// Unknown reply types without the error bit may be ignored (proto.md).
		}
	}
}

func writeOption(w io.Writer, opt uint32, data []byte) error {
	buf := make([]byte, 16+len(data))
	binary.BigEndian.PutUint64(buf, nbdproto.MagicOpt)
	binary.BigEndian.PutUint32(buf[8:], opt)
	binary.BigEndian.PutUint32(buf[12:], uint32(len(data)))
	copy(buf[16:], data)
	if _, err := w.Write(buf); err != nil {
		return fmt.Errorf("nbd handshake: send option: %w", err)
	}
	return nil
}

func readOptReply(r io.Reader, opt uint32) (uint32, []byte, error) {
	var h [20]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, fmt.Errorf("nbd handshake: read option reply: %w", err)
	}
	if binary.BigEndian.Uint64(h[0:]) != nbdproto.MagicOptReply {
		return 0, nil, errors.New("nbd handshake: bad option reply magic")
	}
	if got := binary.BigEndian.Uint32(h[8:]); got != opt {
		return 0, nil, fmt.Errorf("nbd handshake: reply for option %d, expected %d", got, opt)
	}
	typ := binary.BigEndian.Uint32(h[12:])
	n := binary.BigEndian.Uint32(h[16:])
	if n > maxOptReply {
		return 0, nil, fmt.Errorf("nbd handshake: option reply of %d bytes is too long", n)
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, nil, fmt.Errorf("nbd handshake: read option reply: %w", err)
	}
	return typ, payload, nil
}

// Conn returns the underlying connection, e.g. to hand it to the kernel once negotiated.
func (c *Client) Conn() net.Conn { return c.conn }

// Error is an error reply from the server.
type Error struct {
	Op    string
	Errno syscall.Errno
}

func (e *Error) Error() string { return fmt.Sprintf("nbd %s: server replied %v", e.Op, e.Errno) }
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
	binary.BigEndian.PutUint32(h[0:], nbdproto.MagicRequest)
	binary.BigEndian.PutUint16(h[4:], flags)
	binary.BigEndian.PutUint16(h[6:], cmd)
	binary.BigEndian.PutUint64(h[8:], c.handle)
	binary.BigEndian.PutUint64(h[16:], off)
	binary.BigEndian.PutUint32(h[24:], length)
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
	clear(h)
	binary.BigEndian.PutUint32(h[0:], nbdproto.MagicRequest)
	binary.BigEndian.PutUint16(h[6:], nbdproto.CmdDisc)
	binary.BigEndian.PutUint64(h[8:], c.handle)
	_, werr := c.conn.Write(h)
	cerr := c.conn.Close()
	if werr != nil {
		return werr
	}
	return cerr
}

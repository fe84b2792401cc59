package nbdclient

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// maxErrorMessage bounds the message of a structured error chunk (proto.md: "at most
// 4096 bytes").
const maxErrorMessage = 4096

// op is one request as it goes over the wire. Its reply fields (covered, serr) belong to
// the reader of the connection it was last sent on; a Remote re-sends an op only after
// that reader has exited.
type op struct {
	cmd, flags uint16
	off        uint64
	length     uint32
	data       []byte // NBD_CMD_WRITE payload (len == length)
	buf        []byte // NBD_CMD_READ destination (len == length)

	// Bookkeeping of the Remote (under Remote.mu).
	seq       uint64        // submission order
	weight    int64         // room in flight it holds, given back by finish
	ackSeq    uint64        // order of acknowledgement, for the replay log
	flushMark uint64        // a FLUSH covers the writes acknowledged up to this ackSeq
	keep      []byte        // a copy of data, for the replay log
	logEntry  bool          // a replay of an acknowledged write: nobody waits for it
	direct    bool          // sent outside the pending set (Verify's reads): complete closes fin
	start     time.Time     // when its call began, for Health
	sentAt    time.Time     // when it last went on the wire, for the watchdog
	conn      *pconn        // the connection it was last sent on
	err       error         // the result, valid once fin is closed
	fin       chan struct{} // closed when the op leaves the pending set

	covered uint64 // read bytes the structured reply has covered so far
	serr    error  // first error chunk of a structured reply
}

func (o *op) isWrite() bool {
	return o.cmd == nbdproto.CmdWrite || o.cmd == nbdproto.CmdTrim || o.cmd == nbdproto.CmdWriteZeroes
}

func (o *op) overlaps(p *op) bool {
	return o.off < p.off+uint64(p.length) && p.off < o.off+uint64(o.length)
}

func opName(cmd uint16) string {
	switch cmd {
	case nbdproto.CmdRead:
		return "read"
	case nbdproto.CmdWrite:
		return "write"
	case nbdproto.CmdFlush:
		return "flush"
	case nbdproto.CmdTrim:
		return "trim"
	case nbdproto.CmdWriteZeroes:
		return "write-zeroes"
	}
	return fmt.Sprintf("command %d", cmd)
}

// errProtocol marks a reply that breaks the protocol: the connection is dropped.
var errProtocol = errors.New("nbd: protocol error")

func protoErr(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errProtocol, fmt.Sprintf(format, a...))
}

// pconn is one connection in the transmission phase with any number of requests in
// flight: writers send under wmu, one reader goroutine matches replies by cookie.
type pconn struct {
	nc         net.Conn
	structured bool
	gen        uint64 // the Remote's connection generation it belongs to
	timeout    time.Duration

	wmu sync.Mutex
	hdr [nbdproto.RequestHeaderLen]byte

	mu     sync.Mutex
	ops    map[uint64]*op
	cookie uint64
	err    error

	readerDone chan struct{}
	reply      func(*op, error)    // the server answered op
	dead       func(*pconn, error) // the connection failed (called once)
}

func newPconn(n negotiated, gen uint64, timeout time.Duration, reply func(*op, error), dead func(*pconn, error)) *pconn {
	c := &pconn{
		nc: n.conn, structured: n.structured, gen: gen, timeout: timeout,
		ops: make(map[uint64]*op), readerDone: make(chan struct{}),
		reply: reply, dead: dead,
	}
	go c.readLoop()
	return c
}

// send puts o on the wire. A write error fails the whole connection (the caller learns
// of it through dead); an error return means the connection had failed already.
func (c *pconn) send(o *op) error {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return c.err
	}
	c.cookie++
	cookie := c.cookie
	c.ops[cookie] = o
	c.mu.Unlock()

	c.wmu.Lock()
	putRequest(c.hdr[:], o.flags, o.cmd, cookie, o.off, o.length)
	if c.timeout > 0 {
		c.nc.SetWriteDeadline(time.Now().Add(c.timeout))
	}
	var err error
	if o.cmd == nbdproto.CmdWrite {
		bufs := net.Buffers{c.hdr[:], o.data}
		_, err = bufs.WriteTo(c.nc)
	} else {
		_, err = c.nc.Write(c.hdr[:])
	}
	c.wmu.Unlock()
	if err != nil {
		c.fail(fmt.Errorf("nbd: send %s: %w", opName(o.cmd), err))
	}
	return nil
}

// fail closes the connection once; the first error sticks.
func (c *pconn) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	c.ops = nil
	c.mu.Unlock()
	c.nc.Close()
	if c.dead != nil {
		c.dead(c, err)
	}
}

// failed returns the error the connection failed with, or nil while it works.
func (c *pconn) failed() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// quiesce waits until no goroutine reads a request's buffer or writes a reply into one:
// once the connection is closed, a write in progress returns at once, and a send that
// had not started finds the connection closed and writes nothing.
func (c *pconn) quiesce() {
	<-c.readerDone
	c.wmu.Lock()
	c.wmu.Unlock()
}

// disconnect sends NBD_CMD_DISC (best effort) and closes.
func (c *pconn) disconnect() {
	c.mu.Lock()
	alive := c.err == nil
	c.mu.Unlock()
	if alive {
		c.wmu.Lock()
		putRequest(c.hdr[:], 0, nbdproto.CmdDisc, 0, 0, 0)
		c.nc.SetWriteDeadline(time.Now().Add(time.Second))
		c.nc.Write(c.hdr[:])
		c.wmu.Unlock()
	}
	c.fail(errClosed)
	c.quiesce()
}

func (c *pconn) lookup(cookie uint64, remove bool) *op {
	c.mu.Lock()
	defer c.mu.Unlock()
	o := c.ops[cookie]
	if remove && o != nil {
		delete(c.ops, cookie)
	}
	return o
}

func (c *pconn) readLoop() {
	defer close(c.readerDone)
	err := c.readReplies(bufio.NewReaderSize(c.nc, 128<<10))
	c.fail(err)
}

func (c *pconn) readReplies(br *bufio.Reader) error {
	var h [nbdproto.StructuredHeaderLen]byte
	for {
		if _, err := io.ReadFull(br, h[:4]); err != nil {
			return fmt.Errorf("nbd: read reply: %w", err)
		}
		switch magic := binary.BigEndian.Uint32(h[:4]); magic {
		case nbdproto.MagicSimpleReply:
			if _, err := io.ReadFull(br, h[4:nbdproto.SimpleReplyHeaderLen]); err != nil {
				return fmt.Errorf("nbd: read reply: %w", err)
			}
			errno := binary.BigEndian.Uint32(h[4:])
			cookie := binary.BigEndian.Uint64(h[8:])
			o := c.lookup(cookie, true)
			if o == nil {
				return protoErr("reply for unknown cookie %d", cookie)
			}
			if errno != 0 {
				c.reply(o, &Error{Op: opName(o.cmd), Errno: nbdErrno(errno)})
				continue
			}
			if o.cmd == nbdproto.CmdRead {
				if _, err := io.ReadFull(br, o.buf); err != nil {
					return fmt.Errorf("nbd: read data: %w", err)
				}
			}
			c.reply(o, nil)
		case nbdproto.MagicStructuredReply:
			if !c.structured {
				return protoErr("structured reply without NBD_OPT_STRUCTURED_REPLY")
			}
			if _, err := io.ReadFull(br, h[4:]); err != nil {
				return fmt.Errorf("nbd: read reply: %w", err)
			}
			flags := binary.BigEndian.Uint16(h[4:])
			typ := binary.BigEndian.Uint16(h[6:])
			cookie := binary.BigEndian.Uint64(h[8:])
			length := binary.BigEndian.Uint32(h[16:])
			o := c.lookup(cookie, false)
			if o == nil {
				return protoErr("reply chunk for unknown cookie %d", cookie)
			}
			if err := c.chunk(br, o, typ, length); err != nil {
				return err
			}
			if flags&nbdproto.ReplyFlagDone != 0 {
				c.lookup(cookie, true)
				res := o.serr
				if res == nil && o.cmd == nbdproto.CmdRead && o.covered != uint64(o.length) {
					res = &Error{Op: "read", Errno: syscall.EIO, Msg: fmt.Sprintf("server's reply covered %d of %d bytes", o.covered, o.length)}
				}
				c.reply(o, res)
			}
		default:
			return protoErr("bad reply magic %#x", magic)
		}
	}
}

// chunk consumes one structured reply chunk of o, bounding every length by what o asked.
func (c *pconn) chunk(br *bufio.Reader, o *op, typ uint16, length uint32) error {
	var b [12]byte
	inRange := func(off, n uint64) (uint64, bool) {
		if off < o.off || off-o.off > uint64(o.length) || n > uint64(o.length)-(off-o.off) {
			return 0, false
		}
		return off - o.off, true
	}
	switch {
	case typ == nbdproto.ChunkNone:
		if length != 0 {
			return protoErr("NBD_REPLY_TYPE_NONE with %d bytes", length)
		}
	case typ == nbdproto.ChunkOffsetData:
		if o.cmd != nbdproto.CmdRead || length < 8 || length-8 > o.length {
			return protoErr("bad NBD_REPLY_TYPE_OFFSET_DATA (%d bytes) for %s of %d", length, opName(o.cmd), o.length)
		}
		if _, err := io.ReadFull(br, b[:8]); err != nil {
			return err
		}
		n := uint64(length - 8)
		at, ok := inRange(binary.BigEndian.Uint64(b[:8]), n)
		if !ok {
			return protoErr("NBD_REPLY_TYPE_OFFSET_DATA outside the request")
		}
		if _, err := io.ReadFull(br, o.buf[at:at+n]); err != nil {
			return err
		}
		o.covered += n
	case typ == nbdproto.ChunkOffsetHole:
		if o.cmd != nbdproto.CmdRead || length != 12 {
			return protoErr("bad NBD_REPLY_TYPE_OFFSET_HOLE (%d bytes) for %s", length, opName(o.cmd))
		}
		if _, err := io.ReadFull(br, b[:12]); err != nil {
			return err
		}
		n := uint64(binary.BigEndian.Uint32(b[8:]))
		at, ok := inRange(binary.BigEndian.Uint64(b[:8]), n)
		if !ok || n == 0 {
			return protoErr("NBD_REPLY_TYPE_OFFSET_HOLE outside the request")
		}
		clear(o.buf[at : at+n])
		o.covered += n
	case typ&(1<<15) != 0:
		// Every error chunk type, known or not, starts with error and message length
		// (proto.md "Structured reply types").
		if length < nbdproto.ChunkErrorPayloadLen || length > nbdproto.ChunkErrorPayloadLen+maxErrorMessage+8 {
			return protoErr("error chunk of %d bytes", length)
		}
		p := make([]byte, length)
		if _, err := io.ReadFull(br, p); err != nil {
			return err
		}
		errno := binary.BigEndian.Uint32(p)
		msgLen := uint32(binary.BigEndian.Uint16(p[4:]))
		if nbdproto.ChunkErrorPayloadLen+msgLen > length ||
			(typ == nbdproto.ChunkErrorOffset && length != nbdproto.ChunkErrorPayloadLen+msgLen+8) ||
			(typ == nbdproto.ChunkError && length != nbdproto.ChunkErrorPayloadLen+msgLen) {
			return protoErr("malformed error chunk")
		}
		if errno == 0 {
			return protoErr("error chunk with error 0")
		}
		if o.serr == nil {
			o.serr = &Error{Op: opName(o.cmd), Errno: nbdErrno(errno), Msg: string(p[6 : 6+msgLen])}
		}
	default:
		return protoErr("unknown reply chunk type %d", typ)
	}
	return nil
}

package nbd

import (
	"encoding/binary"
	"io"
	"net"
	"sync"
	"sync/atomic"

	"github.com/elidisk/eli/nbd/nbdproto"
)

// replyWriter serialises replies from the workers onto the connection. Small replies are
// gathered and written by whichever worker is the last one waiting for the lock, so a
// burst of completions costs one syscall, yet no reply waits for one that is not ready.
// Large read data goes out in one writev with the headers gathered before it.
type replyWriter struct {
	mu      sync.Mutex
	w       io.Writer
	pending []byte
	vec     [2][]byte
	waiting atomic.Int32
	err     error
}

const (
	// inlineData is the largest read payload copied into the gathering buffer rather than
	// passed to writev; copying 16 KiB costs less than the extra syscall it can save.
	inlineData = 16 << 10
	// flushAt bounds the gathering buffer.
	flushAt = 128 << 10
)

func (o *replyWriter) send(hdr, data []byte) error {
	o.waiting.Add(1)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.waiting.Add(-1)
	if o.err != nil {
		return o.err
	}
	o.pending = append(o.pending, hdr...)
	if len(data) > inlineData {
		o.vec[0], o.vec[1] = o.pending, data
		bufs := net.Buffers(o.vec[:])
		_, err := bufs.WriteTo(o.w)
		o.vec[0], o.vec[1] = nil, nil
		o.pending = o.pending[:0]
		o.err = err
		return err
	}
	o.pending = append(o.pending, data...)
	if o.waiting.Load() == 0 || len(o.pending) >= flushAt {
		_, err := o.w.Write(o.pending)
		o.pending = o.pending[:0]
		o.err = err
	}
	return o.err
}

func (o *replyWriter) failure() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// sent ends the connection if a reply could not be written: the client would wait forever
// for it otherwise.
func (c *conn) sent(err error) {
	if err != nil {
		c.abort()
	}
}

func putSimpleHeader(b []byte, code uint32, handle uint64) {
	binary.BigEndian.PutUint32(b[0:], nbdproto.MagicSimpleReply)
	binary.BigEndian.PutUint32(b[4:], code)
	binary.BigEndian.PutUint64(b[8:], handle)
}

func putChunkHeader(b []byte, flags, typ uint16, handle uint64, length uint32) {
	binary.BigEndian.PutUint32(b[0:], nbdproto.MagicStructuredReply)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], typ)
	binary.BigEndian.PutUint64(b[8:], handle)
	binary.BigEndian.PutUint32(b[16:], length)
}

// replyOK answers a successful request that returns no data. A simple reply is allowed for
// it even when structured replies were negotiated (proto.md "Simple reply message").
func (c *conn) replyOK(r *request) {
	var h [nbdproto.SimpleReplyHeaderLen]byte
	putSimpleHeader(h[:], 0, r.handle)
	c.sent(c.out.send(h[:], nil))
}

// replyRead answers a successful read with all its data: one NBD_REPLY_TYPE_OFFSET_DATA
// chunk flagged DONE (it cannot fail once sent, the data is in memory), or for an empty
// read one NBD_REPLY_TYPE_NONE chunk, since a data chunk must carry at least one byte.
func (c *conn) replyRead(r *request, data []byte) {
	if !c.structured {
		var h [nbdproto.SimpleReplyHeaderLen]byte
		putSimpleHeader(h[:], 0, r.handle)
		c.sent(c.out.send(h[:], data))
		return
	}
	if len(data) == 0 {
		var h [nbdproto.StructuredHeaderLen]byte
		putChunkHeader(h[:], nbdproto.ReplyFlagDone, nbdproto.ChunkNone, r.handle, 0)
		c.sent(c.out.send(h[:], nil))
		return
	}
	var h [nbdproto.StructuredHeaderLen + 8]byte
	putChunkHeader(h[:], nbdproto.ReplyFlagDone, nbdproto.ChunkOffsetData, r.handle, uint32(8+len(data)))
	binary.BigEndian.PutUint64(h[nbdproto.StructuredHeaderLen:], r.off)
	c.sent(c.out.send(h[:], data))
}

// replyError answers a failed request. With structured replies it is an error chunk with
// a message (and the failing offset when known: errOff >= 0); without them a simple reply
// with the error and, for a read, no data: a failed read never sends bytes that could be
// taken for its contents.
func (c *conn) replyError(r *request, code uint32, msg string, errOff int64) {
	if !c.structured {
		var h [nbdproto.SimpleReplyHeaderLen]byte
		putSimpleHeader(h[:], code, r.handle)
		c.sent(c.out.send(h[:], nil))
		return
	}
	msg = wireMessage(msg)
	typ := uint16(nbdproto.ChunkError)
	n := nbdproto.ChunkErrorPayloadLen + len(msg)
	if errOff >= 0 {
		typ = nbdproto.ChunkErrorOffset
		n += 8
	}
	b := make([]byte, nbdproto.StructuredHeaderLen+n)
	putChunkHeader(b, nbdproto.ReplyFlagDone, typ, r.handle, uint32(n))
	p := b[nbdproto.StructuredHeaderLen:]
	binary.BigEndian.PutUint32(p[0:], code)
	binary.BigEndian.PutUint16(p[4:], uint16(len(msg)))
	copy(p[6:], msg)
	if errOff >= 0 {
		binary.BigEndian.PutUint64(p[6+len(msg):], uint64(errOff))
	}
	c.sent(c.out.send(b, nil))
}

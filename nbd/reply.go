package nbd

import (
	"encoding/binary"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// replyWriter serialises replies from the workers onto the connection. Small replies are
// gathered and written by whichever worker is the last one waiting for the lock, so a
// burst of completions costs one syscall. Large read data goes out in one writev with the
// headers gathered before it.
//
// A small reply also waits for a later one while other requests of the connection run
// (busy). On two cores a worker seldom finds another waiting for the lock, so a client
// that keeps many requests in flight got one system call per reply, and read them one
// at a time; a client that keeps many in flight is not waiting for any one of them. The
// last request to finish writes them all. A reply waits for at most maxGathered others
// and gatherBound of time, so a slow request (a remote provider's read) does not hold up
// the fast ones around it. Replies to FLUSH and FUA writes never wait, since a client
// that flushes is waiting for that reply, nor do the errors the reader sends for requests
// it refuses. A request that arrives alone (queue depth 1) finds nothing else busy and is
// answered at once.
//
// Every write has a deadline (the server's transfer deadline for its size): a client that
// stops reading its replies cannot hold the budget of the requests it is owed forever.
// The first failed write ends the connection. Moving the deadline costs more than a small
// write, so it moves only when less than slack of it would remain: a write then has
// between slack and 2×slack plus its size allowance.
type replyWriter struct {
	mu       sync.Mutex
	w        io.Writer
	dl       interface{ SetWriteDeadline(time.Time) error }
	deadline func(n int64) time.Time
	pace     func(start time.Time, n int64) time.Time // for stream
	slack    time.Duration
	until    time.Time // the deadline set now
	pending  []byte
	vec      [2][]byte
	waiting  atomic.Int32
	err      error

	// Replies waiting for later ones (see above).
	busy       atomic.Int32  // requests running whose replies may wait for a later one
	gathered   int           // guarded by mu: replies in pending that wait so
	gatheredAt time.Time     // guarded by mu: when the first of them was gathered
	bound      *time.Timer   // writes replies that waited too long: checkBound
	abort      func()        // ends the connection when checkBound's write fails
	boundAfter time.Duration // gatherBound, or the server's override for tests
	watching   bool          // guarded by mu: bound is armed
	writes     uint64        // guarded by mu: system calls that wrote replies, for tests
}

const (
	// inlineData is the largest read payload copied into the gathering buffer rather than
	// passed to writev; copying 16 KiB costs less than the extra syscall it can save.
	inlineData = 16 << 10
	// flushAt bounds the gathering buffer.
	flushAt = 128 << 10
)

const (
	// maxGathered is how many replies wait for a later one at most. Under fio's random
	// 4 KiB writes at queue depth 32, 4, 8 and 16 did alike (alternating rounds, eli
	// none and the default mode); BenchmarkServer's pipelining client, which shares the
	// server's cores and runtime, writes 4 KiB faster with 8 than without gathering, and
	// slower with 16 than without, since bursts of 16 replies leave it idle between them
	// (docs/benchmarks.md, "Measurements behind design choices").
	maxGathered = 8
	// gatherBound is how long a reply waits for a later one at most; the watch that
	// notices it may take as long again.
	gatherBound = 200 * time.Microsecond
)

// lock takes the writer, counted among those waiting for it meanwhile (send writes what
// is gathered only when no one else waits), and returns the error that ended its writes,
// if one did; o.mu is held either way.
func (o *replyWriter) lock() error {
	o.waiting.Add(1)
	o.mu.Lock()
	o.waiting.Add(-1)
	return o.err
}

func (o *replyWriter) send(hdr, data []byte, mayWait bool) error {
	err := o.lock()
	defer o.mu.Unlock()
	if err != nil {
		return err
	}
	o.pending = append(o.pending, hdr...)
	if len(data) > inlineData {
		return o.writeWith(data)
	}
	o.pending = append(o.pending, data...)
	if mayWait && o.busy.Load() > 0 && o.gathered < maxGathered && len(o.pending) < flushAt {
		if o.gathered == 0 {
			o.gatheredAt = time.Now()
			o.watch()
		}
		o.gathered++
		return nil
	}
	if o.waiting.Load() == 0 || len(o.pending) >= flushAt {
		o.writePending()
	}
	return o.err
}

// writeWith writes the gathered replies and data after them in one system call, within
// the deadline for their size; o.mu is held.
func (o *replyWriter) writeWith(data []byte) error {
	o.setDeadline(len(o.pending) + len(data))
	return o.writeVec(data)
}

// writeVec is writeWith under the deadline already set.
func (o *replyWriter) writeVec(data []byte) error {
	o.vec[0], o.vec[1] = o.pending, data
	var err error
	if vw, ok := o.w.(buffersWriter); ok {
		_, err = vw.WriteBuffers(o.vec[:])
	} else {
		bufs := net.Buffers(o.vec[:])
		_, err = bufs.WriteTo(o.w)
	}
	o.vec[0], o.vec[1] = nil, nil
	o.pending = o.pending[:0]
	o.gathered = 0
	o.writes++
	o.err = err
	return err
}

// stream writes one reply whose data comes in parts (a streamed read: stream.go), holding
// the writer throughout so that no other reply lands inside it: hdr after the replies
// gathered so far, then each part fill passes to write, each due at the pace the whole
// reply would be (pace), not in the time of a reply of its size. It returns the first
// error of write or of fill; the caller decides whether the reply can still be completed.
func (o *replyWriter) stream(hdr []byte, fill func(write func(p []byte) error) error) error {
	err := o.lock()
	defer o.mu.Unlock()
	if err != nil {
		return err
	}
	o.pending = append(o.pending, hdr...)
	start, sent := time.Now(), int64(0)
	var wrote time.Time // when the last piece was written
	return fill(func(p []byte) error {
		if !wrote.IsZero() {
			// The pace is the client's: what fill did between two pieces (the
			// backend's read, which a suspended volume holds) does not count.
			start = start.Add(time.Since(wrote))
		}
		sent += int64(len(o.pending) + len(p))
		if o.dl != nil {
			o.until = o.pace(start, sent)
			o.dl.SetWriteDeadline(o.until)
		}
		err := o.writeVec(p)
		wrote = time.Now()
		return err
	})
}

// writePending writes the gathered replies; o.mu is held.
func (o *replyWriter) writePending() {
	o.setDeadline(len(o.pending))
	_, err := o.w.Write(o.pending)
	o.pending = o.pending[:0]
	o.gathered = 0
	o.writes++
	o.err = err
}

// watch arms the bound timer unless it is armed already; o.mu is held. One timer serves
// a stream of gathered replies, as for inline requests (inline.go's watch): arming and
// stopping one per gathering would cost more than the system call it saves.
func (o *replyWriter) watch() {
	if !o.watching {
		o.watching = true
		o.bound.Reset(o.boundAfter)
	}
}

// checkBound runs in the bound timer's goroutine: it writes replies that have waited for
// gatherBound, arms the timer again for the rest of a younger gathering, and otherwise
// ends the watch until the next. A failed write ends the connection, as a failed send
// does (conn.sent): no request may be left waiting for a later reply to notice it.
func (o *replyWriter) checkBound() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.gathered > 0 && o.err == nil {
		if waited := time.Since(o.gatheredAt); waited < o.boundAfter {
			o.bound.Reset(o.boundAfter - waited)
			return
		}
		if o.writePending(); o.err != nil {
			o.abort()
		}
	}
	o.watching = false
}

// buffersWriter writes several buffers in one system call (rawConn).
type buffersWriter interface {
	WriteBuffers(bufs [][]byte) (int64, error)
}

func (o *replyWriter) setDeadline(n int) {
	if o.dl == nil {
		return
	}
	if d := o.deadline(int64(n)); o.until.Before(d.Add(-o.slack)) {
		o.until = d
		o.dl.SetWriteDeadline(d)
	}
}

func (o *replyWriter) failure() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// reply sends r's reply, which may wait for a later one if r.gathers.
func (c *conn) reply(r *request, hdr, data []byte) {
	mayWait := r.gathers
	if mayWait {
		r.gathers = false
		c.out.busy.Add(-1)
	}
	c.sent(c.out.send(hdr, data, mayWait))
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

// maxChunkHeader is the larger of the two chunk header sizes.
const maxChunkHeader = nbdproto.ExtendedReplyLen

// putChunkHeader writes a structured reply chunk header, or with extended headers an
// extended one (whose offset field is the request's), and returns its length.
func (c *conn) putChunkHeader(b []byte, flags, typ uint16, r *request, length int) int {
	if c.extended {
		binary.BigEndian.PutUint32(b[0:], nbdproto.MagicExtendedReply)
		binary.BigEndian.PutUint16(b[4:], flags)
		binary.BigEndian.PutUint16(b[6:], typ)
		binary.BigEndian.PutUint64(b[8:], r.handle)
		binary.BigEndian.PutUint64(b[16:], r.off)
		binary.BigEndian.PutUint64(b[24:], uint64(length))
		return nbdproto.ExtendedReplyLen
	}
	binary.BigEndian.PutUint32(b[0:], nbdproto.MagicStructuredReply)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], typ)
	binary.BigEndian.PutUint64(b[8:], r.handle)
	binary.BigEndian.PutUint32(b[16:], uint32(length))
	return nbdproto.StructuredHeaderLen
}

// replyOK answers a successful request that returns no data. A simple reply is allowed for
// it even when structured replies were negotiated (proto.md "Simple reply message"); with
// extended headers it is a NONE chunk, since simple replies are not allowed then.
func (c *conn) replyOK(r *request) {
	if c.extended {
		var h [maxChunkHeader]byte
		n := c.putChunkHeader(h[:], nbdproto.ReplyFlagDone, nbdproto.ChunkNone, r, 0)
		c.reply(r, h[:n], nil)
		return
	}
	var h [nbdproto.SimpleReplyHeaderLen]byte
	putSimpleHeader(h[:], 0, r.handle)
	c.reply(r, h[:], nil)
}

// replyRead answers a successful read with all its data: one NBD_REPLY_TYPE_OFFSET_DATA
// chunk flagged DONE (it cannot fail once sent, the data is in memory), or for an empty
// read one NBD_REPLY_TYPE_NONE chunk, since a data chunk must carry at least one byte.
func (c *conn) replyRead(r *request, data []byte) {
	if !c.structured {
		var h [nbdproto.SimpleReplyHeaderLen]byte
		putSimpleHeader(h[:], 0, r.handle)
		c.reply(r, h[:], data)
		return
	}
	var h [maxChunkHeader + 8]byte
	if len(data) == 0 {
		n := c.putChunkHeader(h[:], nbdproto.ReplyFlagDone, nbdproto.ChunkNone, r, 0)
		c.reply(r, h[:n], nil)
		return
	}
	n := c.putChunkHeader(h[:], nbdproto.ReplyFlagDone, nbdproto.ChunkOffsetData, r, 8+len(data))
	binary.BigEndian.PutUint64(h[n:], r.off)
	c.reply(r, h[:n+8], data)
}

// replyError answers a failed request. With structured replies it is an error chunk with
// a message (and the failing offset when known: errOff >= 0); without them a simple reply
// with the error and, for a read, no data: a failed read never sends bytes that could be
// taken for its contents.
func (c *conn) replyError(r *request, code uint32, msg string, errOff int64) {
	if !c.structured {
		var h [nbdproto.SimpleReplyHeaderLen]byte
		putSimpleHeader(h[:], code, r.handle)
		c.reply(r, h[:], nil)
		return
	}
	msg = wireMessage(msg)
	typ := uint16(nbdproto.ChunkError)
	n := nbdproto.ChunkErrorPayloadLen + len(msg)
	if errOff >= 0 {
		typ = nbdproto.ChunkErrorOffset
		n += 8
	}
	b := make([]byte, maxChunkHeader+n)
	hl := c.putChunkHeader(b, nbdproto.ReplyFlagDone, typ, r, n)
	b = b[:hl+n]
	p := b[hl:]
	binary.BigEndian.PutUint32(p[0:], code)
	binary.BigEndian.PutUint16(p[4:], uint16(len(msg)))
	copy(p[6:], msg)
	if errOff >= 0 {
		binary.BigEndian.PutUint64(p[6+len(msg):], uint64(errOff))
	}
	c.reply(r, b, nil)
}

// replyBlockStatus answers NBD_CMD_BLOCK_STATUS with one chunk for the one context there
// is: NBD_REPLY_TYPE_BLOCK_STATUS (32-bit lengths and flags), or with extended headers
// NBD_REPLY_TYPE_BLOCK_STATUS_EXT (64-bit), which proto.md requires then.
func (c *conn) replyBlockStatus(r *request, ext []Extent) {
	per, head, typ := 8, 4, uint16(nbdproto.ChunkBlockStatus)
	if c.extended {
		per, head, typ = 16, 8, nbdproto.ChunkBlockStatusExt
	}
	n := head + per*len(ext)
	b := make([]byte, maxChunkHeader+n)
	hl := c.putChunkHeader(b, nbdproto.ReplyFlagDone, typ, r, n)
	b = b[:hl+n]
	p := b[hl:]
	binary.BigEndian.PutUint32(p, c.metaID)
	if c.extended {
		binary.BigEndian.PutUint32(p[4:], uint32(len(ext)))
	}
	p = p[head:]
	for _, e := range ext {
		var st uint32
		if e.Hole {
			st |= nbdproto.StateHole
		}
		if e.Zero {
			st |= nbdproto.StateZero
		}
		if c.extended {
			binary.BigEndian.PutUint64(p, uint64(e.Length))
			binary.BigEndian.PutUint64(p[8:], uint64(st))
		} else {
			binary.BigEndian.PutUint32(p, uint32(e.Length))
			binary.BigEndian.PutUint32(p[4:], st)
		}
		p = p[per:]
	}
	c.reply(r, b, nil)
}

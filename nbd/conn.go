package nbd

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// readBufSize lets one read syscall take in many small requests at once.
const readBufSize = 64 << 10

const socketBuffer = 4 << 20

// conn is one client connection, from the greeting to the close.
type conn struct {
	s      *Server
	nc     net.Conn // as accepted
	rw     net.Conn // nc through rawConn, or the TLS session over it after NBD_OPT_STARTTLS
	log    *slog.Logger
	start  time.Time
	remote string // for the log
	source string // the peer's IP address for MaxConnsPerSource; "" on a unix socket

	negotiated // in the handshake; read-only in transmission

	inTransmission bool // guarded by s.mu
	evicted        bool // guarded by s.mu

	local    *limiter
	res      *reserve // this connection's share of s.global
	stopper           // stop.go
	work     chan *request
	nworkers int
	workers  sync.WaitGroup
	out      replyWriter
	wrote    atomic.Bool // a write-type request ran, so a final flush is due

	tally // what the closing line reports of the requests

	inliner // running requests in the reader: inline.go
}

// request is one transmission-phase request; its buf holds the WRITE payload or the READ
// data and is pooled.
type request struct {
	flags, typ  uint16
	handle      uint64
	off         uint64
	length      uint64        // 32 bits on the wire unless extended headers are in use
	held        int64         // bytes taken from the server's budget (s.global)
	local       int64         // bytes taken from the connection's (c.local)
	fromReserve bool          // the server's budget came from the connection's reserve
	streamed    bool          // served in pieces: see stream.go
	gathers     bool          // counted in out.busy until its reply: see replyWriter
	arrived     time.Duration // since the connection's start: see tally.slowest
	buf         *[]byte
}

var requestPool = sync.Pool{New: func() any { return new(request) }}

func newConn(s *Server, nc net.Conn) *conn {
	c := &conn{
		s:     s,
		nc:    nc,
		rw:    newRawConn(nc),
		start: time.Now(),
		stopper: stopper{
			rd:   nc,
			done: make(chan struct{}),
		},
		local:  newLimiter(s.maxInFlightPerConn(), s.maxBytesPerConn()),
		res:    newReserve(),
		remote: remoteName(nc),
	}
	if a, ok := nc.RemoteAddr().(*net.TCPAddr); ok {
		c.source = a.IP.String()
	}
	c.log = s.log.With("remote", c.remote)
	if uc, ok := nc.(*net.UnixConn); ok {
		// The default unix socket buffers (about 200 KiB) hold less than one large
		// read reply, so every such reply would block the writer part-way and cost a
		// park and a wakeup; with a few MiB they mostly go out in one call. The kernel
		// caps the size at net.core.[rw]mem_max. TCP is left to the kernel's
		// autotuning, which a fixed size would switch off.
		uc.SetWriteBuffer(socketBuffer)
		uc.SetReadBuffer(socketBuffer)
	}
	c.out.w = c.rw
	c.out.dl = nc
	c.out.deadline = s.transferDeadline
	c.out.pace = s.paceDeadline
	c.out.slack = orDefault(s.IOTimeout, DefaultIOTimeout) / 2
	c.out.boundAfter = orDefault(s.gatherBound, gatherBound)
	c.out.abort = c.abort
	c.out.bound = time.AfterFunc(time.Hour, c.out.checkBound)
	c.out.bound.Stop()
	return c
}

func (c *conn) serve() {
	defer c.s.forget(c)
	c.log.Info("nbd: connection opened")
	if err := c.handshake(); err != nil {
		c.nc.Close()
		level := slog.LevelInfo
		var pe *protocolError
		if errors.As(err, &pe) {
			level = slog.LevelWarn
		}
		c.log.Log(context.Background(), level, "nbd: connection closed in handshake", "reason", err.Error(), "duration", time.Since(c.start).Round(time.Millisecond))
		return
	}
	reason, level := c.transmit()
	attrs := []any{"export", c.exp.Name, "reason", reason,
		"requests", c.requests.Load(), "errors", c.failed.Load(),
		"duration", time.Since(c.start).Round(time.Millisecond),
		"slowest_reply", time.Duration(c.slowest.Load()).Round(time.Microsecond)}
	if err := c.out.failure(); err != nil {
		attrs = append(attrs, "write_error", err.Error())
		level = max(level, slog.LevelWarn)
	}
	c.log.Log(context.Background(), level, "nbd: connection closed", attrs...)
}

// stop asks a connection to end gracefully: in transmission, requests in flight finish
// and are answered, requests still arriving get ESHUTDOWN; in the handshake, options get
// NBD_REP_ERR_SHUTDOWN. After shutdownDrain the reader stops.
func (c *conn) stop() { c.stopAfter(orDefault(c.s.drainTime, shutdownDrain)) }

// abort ends the connection at once.
func (c *conn) abort() {
	c.closeDone()
	c.nc.Close()
}

// transmit runs the transmission phase: it reads requests until the client leaves, the
// protocol breaks or the server stops (here, or in the goroutines it hands the reading on
// to: inline.go), then waits for the requests in flight, flushes the backend if anything
// was written, and closes.
func (c *conn) transmit() (string, slog.Level) {
	c.out.w = c.rw
	c.work = make(chan *request)
	br := bufio.NewReaderSize(c.rw, readBufSize)
	c.inliner.setup(orDefault(c.s.handOnAfter, handOnAfter), func() { c.checkInline(br) })
	reason, level, handedOn := c.readLoop(br)
	if handedOn {
		end := <-c.readEnd
		reason, level = end.reason, end.level
	}
	c.handOn.Stop()
	close(c.work)
	c.workers.Wait()
	c.out.bound.Stop()
	if c.wrote.Load() {
		if err := c.exp.Backend.Flush(); err != nil {
			c.log.Error("nbd: flush at disconnect failed", "export", c.exp.Name, "err", err)
		}
	}
	// For TLS this sends close_notify first, as proto.md asks on NBD_CMD_DISC.
	c.rw.Close()
	return reason, level
}

// maxSkip bounds the payload the server reads and throws away to answer a WRITE it
// refuses (too long, out of range) with an error instead of a disconnect. A longer one
// ends the connection: it is more likely a desynchronised stream than a request.
const maxSkip = 256 << 20

func (c *conn) readLoop(br *bufio.Reader) (reason string, level slog.Level, handedOn bool) {
	var h [nbdproto.ExtendedRequestLen]byte
	hlen, magic := nbdproto.RequestHeaderLen, uint32(nbdproto.MagicRequest)
	if c.extended {
		hlen, magic = nbdproto.ExtendedRequestLen, nbdproto.MagicExtendedRequest
	}
	for {
		if _, err := io.ReadFull(br, h[:hlen]); err != nil {
			return ended(c.readFailure(err, true))
		}
		r := request{
			flags:  binary.BigEndian.Uint16(h[4:]),
			typ:    binary.BigEndian.Uint16(h[6:]),
			handle: binary.BigEndian.Uint64(h[8:]),
			off:    binary.BigEndian.Uint64(h[16:]),
		}
		if c.extended {
			r.length = binary.BigEndian.Uint64(h[24:])
		} else {
			r.length = uint64(binary.BigEndian.Uint32(h[24:]))
		}
		if m := binary.BigEndian.Uint32(h[0:]); m != magic {
			return fmt.Sprintf("protocol error: bad request magic %#08x", m), slog.LevelWarn, false
		}
		if r.typ == nbdproto.CmdDisc {
			return "client disconnected", slog.LevelInfo, false
		}
		c.requests.Add(1)
		// The bytes that follow the header (proto.md "Request message"): a WRITE's data;
		// with extended headers, what NBD_CMD_FLAG_PAYLOAD_LEN announces, and nothing
		// without the flag, for a WRITE too (which check then refuses: the flag is
		// required), since only the flag says that a payload follows.
		var payload uint64
		switch {
		case c.extended:
			if r.flags&nbdproto.CmdFlagPayloadLen != 0 {
				payload = r.length
			}
		case r.typ == nbdproto.CmdWrite:
			payload = r.length
		}
		if c.extended && payload > uint64(c.exp.max) {
			// proto.md: a server SHOULD initiate a hard disconnect if a client sets
			// NBD_CMD_FLAG_PAYLOAD_LEN with a length above its maximum payload.
			return fmt.Sprintf("protocol error: %s with a %d-byte payload exceeds the maximum block size %d", cmdName(r.typ), payload, c.exp.max), slog.LevelWarn, false
		}
		if payload > maxSkip {
			// proto.md lets the server treat such a length as a denial of service and
			// disconnect.
			return fmt.Sprintf("protocol error: %s with a %d-byte payload exceeds the %d-byte limit", cmdName(r.typ), payload, uint64(maxSkip)), slog.LevelWarn, false
		}
		if code, msg := c.check(&r); code != 0 {
			if payload > 0 {
				// Take the payload off the wire without holding it.
				if err := c.skipPayload(br, int64(payload)); err != nil {
					return ended(c.payloadFailure(err, &r))
				}
			}
			c.failed.Add(1)
			c.replyError(&r, code, msg, -1)
			continue
		}
		var held int64
		switch r.typ {
		case nbdproto.CmdRead, nbdproto.CmdWrite:
			held = int64(r.length) // at most MaxRequest: check bounds it by the export's maximum
		case nbdproto.CmdBlockStatus:
			held = maxStatusReply // the reply it may build
		}
		acquired, fromReserve, streamed := false, false, false
		if !c.stopping.Load() {
			if ok, _ := c.local.acquire(held, nil, c.done); ok {
				if acquired, fromReserve, streamed = c.claim(held); !acquired {
					c.local.release(held, nil, false)
				}
			}
		}
		if !acquired && c.unread.Load() {
			return "server handing over", slog.LevelInfo, false
		}
		if !acquired {
			// The server is stopping (or the connection is being torn down): refuse
			// what is still arriving, as proto.md asks ("any subsequently received
			// requests SHOULD be ESHUTDOWN"), rather than drop it unanswered.
			if payload > 0 {
				if err := c.skipPayload(br, int64(payload)); err != nil {
					return ended(c.payloadFailure(err, &r))
				}
			}
			c.failed.Add(1)
			c.replyError(&r, nbdproto.EShutdown, "the server is shutting down", -1)
			continue
		}
		req := requestPool.Get().(*request)
		*req = r
		req.held, req.local = held, held
		req.fromReserve = fromReserve
		if streamed {
			req.held, req.streamed = streamPiece, true
			if r.typ == nbdproto.CmdWrite {
				if reason, level, ok := c.streamWrite(br, req); !ok {
					return reason, level, false
				}
				continue
			}
			req.arrived = time.Since(c.start)
			c.dispatch(req) // streamRead, in a worker
			continue
		}
		if held > 0 && r.typ != nbdproto.CmdBlockStatus {
			req.buf = getBuf(int(held))
		}
		if r.typ == nbdproto.CmdWrite && held > 0 {
			if err := c.readPayload(br, *req.buf, time.Now(), 0); err != nil {
				c.release(req)
				return ended(c.payloadFailure(err, &r))
			}
		}
		// The monotonic clock only, read through the vDSO: a few ns per request.
		req.arrived = time.Since(c.start)
		if r.typ != nbdproto.CmdFlush && r.flags&nbdproto.CmdFlagFUA == 0 {
			req.gathers = true
			c.out.busy.Add(1)
		}
		if c.inlineOK(req, br) {
			if !c.runInline(req) {
				return "", 0, true
			}
			continue
		}
		c.dispatch(req)
	}
}

// ended is a reason for readLoop's end, as readLoop returns it.
func ended(reason string, level slog.Level) (string, slog.Level, bool) { return reason, level, false }

// claim takes a request's share of the server's budget (s.global) for n bytes: up to a
// reserve's worth from the connection's reserve or the shared pool, waiting for either;
// more from the shared pool if it has room now, and otherwise one streamPiece of the
// reserve, with which the request is served in pieces (streamed). A large request never
// waits for the shared pool, so whatever other clients hold there, stalled or not, delays
// it by nothing but the pieces. It reports false if the connection is stopping.
func (c *conn) claim(n int64) (ok, fromReserve, streamed bool) {
	if n > reserveBytes {
		if c.s.global.tryAcquire(n) {
			return true, false, false
		}
		n, streamed = streamPiece, true
	}
	ok, fromReserve = c.s.global.acquire(n, c.res, c.done)
	return ok, fromReserve, ok && streamed
}

// paceStep is the part of a payload whose arrival readPayload checks at a time.
const paceStep = 1 << 20

// readPayload reads the part of a WRITE's payload that begins base bytes into it, for a
// payload that began at start, at the pace paceDeadline sets: its first bytes within
// IOTimeout, then at least the minimum transfer rate on average from the start, checked
// every paceStep. A client that stops part-way is dropped when its next step falls due,
// not when the whole payload would: the budget it holds comes back sooner, and a client
// that keeps sending, however slowly the machine lets it, has the same allowance as if
// the payload were checked once.
func (c *conn) readPayload(br *bufio.Reader, p []byte, start time.Time, base int64) error {
	if br.Buffered() >= len(p) {
		_, err := io.ReadFull(br, p)
		return err
	}
	defer c.setReadDeadline(time.Time{})
	for got := 0; got < len(p); {
		step := min(len(p)-got, paceStep)
		c.setReadDeadline(c.s.paceDeadline(start, base+int64(got+step)))
		n, err := io.ReadFull(br, p[got:got+step])
		got += n
		if err != nil {
			return err
		}
	}
	return nil
}

func (c *conn) skipPayload(br *bufio.Reader, n int64) error {
	if int64(br.Buffered()) >= n {
		_, err := br.Discard(int(n))
		return err
	}
	c.setReadDeadline(c.s.transferDeadline(n))
	_, err := io.CopyN(io.Discard, br, n)
	c.setReadDeadline(time.Time{})
	return err
}

func (c *conn) payloadFailure(err error, r *request) (string, slog.Level) {
	if errors.Is(err, os.ErrDeadlineExceeded) && !c.stopping.Load() {
		return fmt.Sprintf("the client did not send the %d-byte payload of %s in time", r.length, cmdName(r.typ)), slog.LevelWarn
	}
	return c.readFailure(err, false)
}

func (c *conn) readFailure(err error, betweenRequests bool) (string, slog.Level) {
	switch {
	case c.stopping.Load():
		return "server shutting down", slog.LevelInfo
	case betweenRequests && errors.Is(err, io.EOF):
		return "client closed the connection without NBD_CMD_DISC", slog.LevelInfo
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return "client closed the connection in the middle of a request", slog.LevelWarn
	case errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrDeadlineExceeded):
		return "connection closed by the server", slog.LevelInfo
	}
	return "read error: " + err.Error(), slog.LevelWarn
}

// check validates a request against the export and what was negotiated before any
// backend work, returning an NBD error value and a message, or 0. The rules are proto.md's
// "Request types", "Block size constraints" and "Error values".
func (n *negotiated) check(r *request) (uint32, string) {
	x := n.exp
	allowed := uint16(nbdproto.CmdFlagFUA) // valid on every command (proto.md "Command flags")
	write := false
	switch r.typ {
	case nbdproto.CmdRead:
		if n.structured {
			allowed |= nbdproto.CmdFlagDF
		}
	case nbdproto.CmdWrite:
		write = true
		if n.extended {
			if r.flags&nbdproto.CmdFlagPayloadLen == 0 {
				// proto.md: with extended headers NBD_CMD_WRITE MUST use the flag.
				return nbdproto.EInval, "NBD_CMD_WRITE with extended headers must set NBD_CMD_FLAG_PAYLOAD_LEN"
			}
			allowed |= nbdproto.CmdFlagPayloadLen
		}
	case nbdproto.CmdTrim:
		write = true
	case nbdproto.CmdWriteZeroes:
		write = true
		allowed |= nbdproto.CmdFlagNoHole | nbdproto.CmdFlagFastZero
	case nbdproto.CmdFlush, nbdproto.CmdCache:
	case nbdproto.CmdBlockStatus:
		if n.metaID == 0 {
			return nbdproto.EInval, "NBD_CMD_BLOCK_STATUS needs a metadata context: select base:allocation with NBD_OPT_SET_META_CONTEXT"
		}
		allowed |= nbdproto.CmdFlagReqOne
	default:
		return nbdproto.EInval, fmt.Sprintf("unknown command %d", r.typ)
	}
	if r.flags&^allowed != 0 {
		return nbdproto.EInval, fmt.Sprintf("command flags %#x are not valid for %s", r.flags&^allowed, cmdName(r.typ))
	}
	if write && x.ReadOnly {
		return nbdproto.EPerm, "the export is read-only"
	}
	if r.typ == nbdproto.CmdFlush {
		if r.off != 0 || r.length != 0 {
			return nbdproto.EInval, "NBD_CMD_FLUSH must have zero offset and length"
		}
		return 0, ""
	}
	end := r.off + r.length
	if end < r.off || end > uint64(x.size) {
		code := uint32(nbdproto.EInval)
		if r.typ == nbdproto.CmdWrite || r.typ == nbdproto.CmdWriteZeroes {
			code = nbdproto.ENoSpc
		}
		return code, fmt.Sprintf("%s of %d bytes at offset %d goes past the end of the export (%d bytes)", cmdName(r.typ), r.length, r.off, x.size)
	}
	if m := uint64(x.minBlock); r.off%m != 0 || r.length%m != 0 {
		return nbdproto.EInval, fmt.Sprintf("%s of %d bytes at offset %d is not aligned to the minimum block size %d", cmdName(r.typ), r.length, r.off, m)
	}
	// Only READ and WRITE carry data, and only their length costs the server memory: it
	// is held to the maximum block size. TRIM, WRITE_ZEROES, CACHE and BLOCK_STATUS are
	// bound by the export's size alone.
	if (r.typ == nbdproto.CmdRead || r.typ == nbdproto.CmdWrite) && r.length > uint64(x.max) {
		return nbdproto.EInval, fmt.Sprintf("%s of %d bytes exceeds the maximum block size %d", cmdName(r.typ), r.length, x.max)
	}
	if r.typ == nbdproto.CmdBlockStatus && r.length == 0 {
		return nbdproto.EInval, "NBD_CMD_BLOCK_STATUS of 0 bytes"
	}
	return 0, ""
}

func cmdName(t uint16) string {
	switch t {
	case nbdproto.CmdRead:
		return "NBD_CMD_READ"
	case nbdproto.CmdWrite:
		return "NBD_CMD_WRITE"
	case nbdproto.CmdDisc:
		return "NBD_CMD_DISC"
	case nbdproto.CmdFlush:
		return "NBD_CMD_FLUSH"
	case nbdproto.CmdTrim:
		return "NBD_CMD_TRIM"
	case nbdproto.CmdCache:
		return "NBD_CMD_CACHE"
	case nbdproto.CmdWriteZeroes:
		return "NBD_CMD_WRITE_ZEROES"
	case nbdproto.CmdBlockStatus:
		return "NBD_CMD_BLOCK_STATUS"
	}
	return fmt.Sprintf("command %d", t)
}

// dispatch hands req to an idle worker, starting one if none is idle and the connection
// has fewer than its in-flight limit. Workers are reused rather than started per request,
// which keeps the grown stacks of deep backends (crypto, I/O) warm.
func (c *conn) dispatch(req *request) {
	select {
	case c.work <- req:
		return
	default:
	}
	if c.nworkers < c.s.maxInFlightPerConn() {
		c.nworkers++
		c.workers.Add(1)
		go c.worker()
	}
	c.work <- req
}

func (c *conn) worker() {
	defer c.workers.Done()
	for req := range c.work {
		c.handle(req)
	}
}

// answered records how long req waited for its replies (tally.slowest).
func (c *conn) answered(req *request) { c.tally.waited(time.Since(c.start) - req.arrived) }

// tally counts a connection's requests, for its closing line.
type tally struct {
	requests, failed atomic.Uint64
	// slowest is the longest a request waited for its reply, in nanoseconds: from its
	// arrival (a WRITE's, once its payload is in) to its last reply's write, or to its
	// joining a gathering (replyWriter), which is written within gatherBound. The
	// connection's closing line gives it, so that a client that timed a request out can
	// be told apart from a server that was slow to answer it. (The reader's refusals,
	// answered at once, are not counted.)
	slowest atomic.Int64
}

// waited records that a request waited d for its replies.
func (t *tally) waited(d time.Duration) {
	took := int64(d)
	for old := t.slowest.Load(); took > old && !t.slowest.CompareAndSwap(old, took); old = t.slowest.Load() {
	}
}

func (c *conn) release(req *request) {
	if req.buf != nil {
		putBuf(req.buf)
		req.buf = nil
	}
	c.s.global.release(req.held, c.res, req.fromReserve)
	c.local.release(req.local, nil, false)
	requestPool.Put(req)
}

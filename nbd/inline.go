package nbd

import (
	"bufio"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// A client that sends one request at a time (fio at queue depth 1, a database's
// synchronous writes, a kernel device under light load) waits for every hand-off between
// the goroutine that reads its requests and the worker that runs them: the worker must
// be woken, often on another thread, and on a VM that wake costs more than a small
// request's work (docs/benchmarks.md, "Measurements behind design choices"). So the
// reader runs a small READ or WRITE, or a FLUSH, itself when nothing else of the
// connection is in flight and nothing more has arrived: the client is then most likely
// waiting for this reply before it sends again. A FLUSH (or a FUA write) waits for a
// commit, which on a provider in memory takes less than the hand-off would add to it,
// and a client that writes and flushes one request at a time (a database's commits)
// pays two hand-offs per write otherwise.
//
// That is a guess about the client, and a client that does send more meanwhile must not
// wait for a slow request: requests of one connection run concurrently and are answered
// in any order (proto.md, "Ordering of messages and writes"). So if the request runs
// longer than handOnAfter, a timer hands the reading on to a new goroutine, which carries
// on with the same buffered stream, and the first goroutine ends when its request does.
// After a hand-on the reader dispatches the next inlineBackoff eligible requests, so that
// a backend whose requests are slow (a remote or disk provider) costs a pipelining client
// at most one handOnAfter now and then, not on every request.

const (
	// inlineMax is the largest READ or WRITE the reader runs itself. Up to here the
	// hand-off it saves (dear on a VM) is worth more than what a request sent meanwhile
	// may wait: the inline request's own time, which for 1 MiB on tmpfs is within
	// handOnAfter (docs/benchmarks.md, "Measurements behind design choices": fio at
	// queue depth 1, and requests of 256 KiB and 1 MiB).
	inlineMax = 1 << 20
	// handOnAfter is how long an inline request runs before the reading is handed on;
	// the watch that notices it may take as long again.
	handOnAfter = time.Millisecond
	// inlineBackoff is how many eligible requests go to workers after a hand-on.
	inlineBackoff = 64
)

// inliner is a connection's state for running requests in the reader.
type inliner struct {
	// inlined and handedOn count requests run so and hand-ons, for tests; per
	// connection, so that no cache line is shared between connections on the request
	// path.
	inlined, handedOn atomic.Uint64
	inlining          atomic.Int32  // inlineNone, inlineRunning or inlineHandedOn
	off               int           // the reader's: eligible requests to hand to workers still
	after             time.Duration // handOnAfter
	handOn            *time.Timer   // hands reading on when an inline request runs long
	watching          atomic.Bool   // handOn is armed
	started           atomic.Int64  // when the reader's inline request started, since the connection's start
	readEnd           chan readEnd  // the reason the last reader ended, after hand-ons
}

// States of inliner.inlining.
const (
	inlineNone     = iota // the reader is reading
	inlineRunning         // the reader is running a request
	inlineHandedOn        // another goroutine took the reading over from it
)

// readEnd is why the reading of a connection ended.
type readEnd struct {
	reason string
	level  slog.Level
}

// setup prepares for the transmission phase: after is handOnAfter, check runs when the
// handOn timer fires.
func (in *inliner) setup(after time.Duration, check func()) {
	in.after = after
	in.readEnd = make(chan readEnd, 1)
	in.handOn = time.AfterFunc(time.Hour, check)
	in.handOn.Stop()
}

// inlineOK reports whether the reader should run req itself: a FLUSH, or a READ or WRITE
// of at most inlineMax bytes, with no other request of the connection in flight and no
// further bytes received.
func (c *conn) inlineOK(req *request, br *bufio.Reader) bool {
	return c.inliner.eligible(req) && br.Buffered() == 0 && c.local.held() == 1 // req's own slot
}

// eligible reports whether req is a FLUSH, or a READ or WRITE of at most inlineMax bytes,
// and the reader is not backing off after a hand-on.
func (in *inliner) eligible(req *request) bool {
	if (req.typ != nbdproto.CmdRead && req.typ != nbdproto.CmdWrite && req.typ != nbdproto.CmdFlush) || req.length > inlineMax {
		return false
	}
	if in.off > 0 {
		in.off--
		return false
	}
	return true
}

// runInline runs req in the reader. It reports whether this goroutine is still the
// reader: false if the request ran long and the reading was handed on meanwhile.
//
// The request counts as a worker from its start, for a reader that takes over to wait
// for at the connection's end: counted by the taker instead, after its takeover, it could
// end (and be uncounted) before it was counted, taking the count below zero.
func (c *conn) runInline(req *request) bool {
	c.workers.Add(1)
	c.inliner.begin(time.Since(c.start))
	c.inliner.watch()
	c.handle(req)
	reader := c.inliner.end()
	c.workers.Done()
	return reader
}

// begin marks the start of an inline request at now, since the connection's start.
func (in *inliner) begin(now time.Duration) {
	in.inlined.Add(1)
	in.started.Store(int64(now))
	in.inlining.Store(inlineRunning)
}

// end marks the end of an inline request. It reports false if the reading was handed on
// meanwhile.
func (in *inliner) end() bool { return in.inlining.CompareAndSwap(inlineRunning, inlineNone) }

// watch arms the handOn timer unless it is armed already. One timer serves a stream of
// inline requests, firing about once per handOnAfter while they last: arming and
// stopping a timer for every request costs more than the hand-off it saves, since an
// idle thread then wakes for the stopped timer.
func (in *inliner) watch() {
	if !in.watching.Load() && in.watching.CompareAndSwap(false, true) {
		in.handOn.Reset(in.after)
	}
}

// checkInline runs in the handOn timer's goroutine, and takes the reading over if the
// reader's inline request has run for handOnAfter.
func (c *conn) checkInline(br *bufio.Reader) {
	if c.inliner.handOnDue(c.start) {
		c.takeOverReading(br)
	}
}

// handOnDue reports whether the reader's inline request has run for handOnAfter, for a
// connection that started at start; it is then marked handed on. If the request is
// younger, the timer is armed again for the rest; if the reader runs none, the watch ends
// until the next.
func (in *inliner) handOnDue(start time.Time) bool {
	if in.inlining.Load() == inlineRunning {
		ran := time.Since(start) - time.Duration(in.started.Load())
		if ran < in.after {
			in.handOn.Reset(in.after - ran)
			return false
		}
		if in.inlining.CompareAndSwap(inlineRunning, inlineHandedOn) {
			in.watching.Store(false)
			return true
		}
	}
	in.watching.Store(false)
	// A request that started after the load above found the watch still on.
	if in.inlining.Load() == inlineRunning {
		in.watch()
	}
	return false
}

// takeOverReading makes this goroutine the reader, and the goroutine left with the inline
// request a worker that ends with it.
func (c *conn) takeOverReading(br *bufio.Reader) {
	if h := c.s.onTakeOver; h != nil {
		h()
	}
	// The goroutine left with the request counts as a worker (runInline), for transmit
	// to wait for. Its request gives its slot in c.local back just before it ends, so
	// this reader may start an inline request in between; the old goroutine's end then
	// finds the state running again and takes the reading back, and there is still one
	// reader at a time, the one the state names.
	c.inliner.handedOn.Add(1)
	c.inliner.off = inlineBackoff
	reason, level, handedOn := c.readLoop(br)
	if !handedOn {
		c.inliner.readEnd <- readEnd{reason, level}
	}
}

package nbd

import (
	"bufio"
	"log/slog"
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

// States of conn.inlining.
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

// inlineOK reports whether the reader should run req itself: a FLUSH, or a READ or WRITE
// of at most inlineMax bytes, with no other request of the connection in flight and no
// further bytes received.
func (c *conn) inlineOK(req *request, br *bufio.Reader) bool {
	if (req.typ != nbdproto.CmdRead && req.typ != nbdproto.CmdWrite && req.typ != nbdproto.CmdFlush) || req.length > inlineMax {
		return false
	}
	if c.inlineOff > 0 {
		c.inlineOff--
		return false
	}
	return br.Buffered() == 0 && c.local.held() == 1 // req's own slot
}

// runInline runs req in the reader. It reports whether this goroutine is still the
// reader: false if the request ran long and the reading was handed on meanwhile.
func (c *conn) runInline(req *request) bool {
	c.inlined.Add(1)
	c.inlineStart.Store(int64(time.Since(c.start)))
	c.inlining.Store(inlineRunning)
	c.watch()
	c.handle(req)
	if c.inlining.CompareAndSwap(inlineRunning, inlineNone) {
		return true
	}
	c.workers.Done() // takeOverReading counted this goroutine as a worker
	return false
}

// watch arms the handOn timer unless it is armed already. One timer serves a stream of
// inline requests, firing about once per handOnAfter while they last: arming and
// stopping a timer for every request costs more than the hand-off it saves, since an
// idle thread then wakes for the stopped timer.
func (c *conn) watch() {
	if !c.watching.Load() && c.watching.CompareAndSwap(false, true) {
		c.handOn.Reset(c.handOnAfter())
	}
}

func (c *conn) handOnAfter() time.Duration { return orDefault(c.s.handOnAfter, handOnAfter) }

// checkInline runs in the handOn timer's goroutine. If the reader's inline request has
// run for handOnAfter, this goroutine takes the reading over; if it is younger, the timer
// is armed again for the rest; if the reader runs none, the watch ends until the next.
func (c *conn) checkInline(br *bufio.Reader) {
	if c.inlining.Load() == inlineRunning {
		ran := time.Since(c.start) - time.Duration(c.inlineStart.Load())
		if ran < c.handOnAfter() {
			c.handOn.Reset(c.handOnAfter() - ran)
			return
		}
		if c.inlining.CompareAndSwap(inlineRunning, inlineHandedOn) {
			c.watching.Store(false)
			c.takeOverReading(br)
			return
		}
	}
	c.watching.Store(false)
	// A request that started after the load above found the watch still on.
	if c.inlining.Load() == inlineRunning {
		c.watch()
	}
}

// takeOverReading makes this goroutine the reader, and the goroutine left with the inline
// request a worker that ends with it.
func (c *conn) takeOverReading(br *bufio.Reader) {
	// The goroutine left with the request is counted as a worker, for transmit to wait
	// for, before this one can end the reading. (Its request holds its slot in c.local
	// until it ends, so no request runs inline meanwhile.)
	c.workers.Add(1)
	c.handedOn.Add(1)
	c.inlineOff = inlineBackoff
	reason, level, handedOn := c.readLoop(br)
	if !handedOn {
		c.readEnd <- readEnd{reason, level}
	}
}

package nbdclient

import (
	"slices"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// replayLog is what a reconnection must make good (guarded by Remote.mu): the
// acknowledged writes that no FLUSH has covered yet, kept to be rewritten (their copies
// bounded by Options.ReplayLimit), the ones it could not keep, and the ranges a
// reconnection may have lost since (see the package documentation for the rule).
type replayLog struct {
	limit   int64  // Options.ReplayLimit
	ackSeq  uint64 // acknowledgements so far
	entries []*op  // acknowledged, not yet flushed writes, in ackSeq order
	bytes   int64  // what entries cost against limit
	unkept  unkeptSpans
	lost    lostSpans // data a reconnection may have lost: flushes fail until rewritten
}

// logEntryCost is what a replay log entry costs beside its data, so that trims and
// zeroes count against ReplayLimit too.
const logEntryCost = 128

// keeps reports whether the log has room for another copy.
func (l *replayLog) keeps() bool { return l.bytes < l.limit }

// flushMark is what a FLUSH sent now covers: the writes acknowledged so far.
func (l *replayLog) flushMark() uint64 { return l.ackSeq }

// durable reports whether a FLUSH may succeed: no range a reconnection lost is still
// unwritten.
func (l *replayLog) durable() bool { return len(l.lost) == 0 }

// acked records a write (or trim, or write-zeroes) the server acknowledged, and keeps it
// until a FLUSH covers it if it is not durable already (flags: the export's).
func (l *replayLog) acked(o *op, flags uint16) {
	if o.cmd != nbdproto.CmdTrim {
		l.lost.rewritten(o.off, o.off+uint64(o.length))
	}
	l.ackSeq++
	o.ackSeq = l.ackSeq
	keep := o.keep
	o.keep = nil
	if flags&nbdproto.TflagSendFlush == 0 || o.flags&nbdproto.CmdFlagFUA != 0 {
		putCopy(keep)
		return // durable once acknowledged
	}
	cost := logEntryCost + int64(len(keep))
	if (o.cmd == nbdproto.CmdWrite && keep == nil) || l.bytes+cost > l.limit {
		putCopy(keep)
		l.unkept.add(span{off: o.off, end: o.off + uint64(o.length), ackSeq: o.ackSeq})
		return
	}
	e := &op{cmd: o.cmd, flags: o.flags, off: o.off, length: o.length, data: keep, ackSeq: o.ackSeq, logEntry: true}
	l.entries = append(l.entries, e)
	l.bytes += cost
}

// flushed drops the entries a successful FLUSH covered.
func (l *replayLog) flushed(mark uint64) {
	i := 0
	for i < len(l.entries) && l.entries[i].ackSeq <= mark {
		l.bytes -= logEntryCost + int64(len(l.entries[i].data))
		putCopy(l.entries[i].data)
		l.entries[i] = nil
		i++
	}
	l.entries = l.entries[i:]
	l.unkept.flushed(mark)
}

// rewriteFailed marks the range of a rewrite that failed lost: its data may be gone.
func (l *replayLog) rewriteFailed(o *op) { l.lost.add(o.off, o.off+uint64(o.length)) }

// reconnected marks lost what the log could not keep, and returns the entries to
// rewrite on the new pool.
func (l *replayLog) reconnected() []*op {
	for _, u := range l.unkept {
		l.lost.add(u.off, u.end)
	}
	l.unkept = l.unkept[:0]
	return slices.Clone(l.entries)
}

// drop forgets the entries: the export they were for is gone.
func (l *replayLog) drop() { l.entries, l.bytes = nil, 0 }

// replay re-sends, on fresh connections, first the log of acknowledged unflushed writes
// in acknowledgement order, then the writes that were in flight in submission order, a
// write never sent while an overlapping one is still unanswered; then the reads and
// flushes in flight. Only then may new requests go. It reports whether the pool is up.
func (r *Remote) replay(conns []*pconn, exp Export) bool {
	writes, rest, ok := r.adopt(conns, exp)
	if !ok { // closed
		for _, c := range conns {
			c.disconnect()
		}
		return true
	}
	return r.rewrite(conns, writes) && r.resend(conns, rest)
}

// adopt makes conns the pool and gathers what goes on it: the log's writes and the
// writes in flight (writes), and the reads and flushes in flight (rest). ok is false if
// the Remote is closed.
func (r *Remote) adopt(conns []*pconn, exp Export) (writes, rest []*op, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, nil, false
	}
	r.pool.adopt(conns, exp)
	r.size.Store(int64(exp.Size))
	logged := r.log.reconnected()
	writes, rest = r.reqs.inFlight()
	return append(logged, writes...), rest, true
}

// rewrite sends writes in their order, none while an overlapping one is unanswered,
// and waits for all. It reports false if a connection failed meanwhile.
func (r *Remote) rewrite(conns []*pconn, writes []*op) bool {
	var inFlight []*op
	drain := func() bool {
		for _, o := range inFlight {
			select {
			case <-o.fin:
			case <-o.conn.readerDone:
				return false
			}
		}
		inFlight = inFlight[:0]
		return true
	}
	for i, o := range writes {
		if slices.ContainsFunc(inFlight, o.overlaps) && !drain() {
			return false
		}
		r.mu.Lock()
		if !o.logEntry {
			if !r.reqs.has(o) { // abandoned by its caller meanwhile
				r.mu.Unlock()
				continue
			}
			// From here its caller, should it give up, closes c and waits for c's
			// writer (quiesce) before taking its buffer back.
		} else {
			r.reqs.track(o)
		}
		c := conns[i%len(conns)]
		o.conn, o.covered, o.serr, o.sentAt = c, 0, nil, time.Now()
		r.mu.Unlock()
		if c.send(o) != nil {
			return false
		}
		inFlight = append(inFlight, o)
	}
	return drain()
}

// resend sends the reads and flushes that were in flight and puts the pool up. It
// reports false if a connection failed meanwhile.
func (r *Remote) resend(conns []*pconn, rest []*op) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, o := range rest {
		if !r.reqs.has(o) {
			continue
		}
		if o.cmd == nbdproto.CmdFlush {
			if !r.log.durable() {
				r.finish(o, ErrDurability)
				continue
			}
			o.flushMark = r.log.flushMark()
		}
		c := conns[i%len(conns)]
		o.conn, o.covered, o.serr, o.sentAt = c, 0, nil, time.Now()
		// Sending under r.mu keeps new requests behind these; a failure here is
		// handled by connDied once the pool is marked up.
		go c.send(o)
	}
	r.pool.markUp()
	for _, c := range conns {
		if c.failed() != nil {
			// Died after the check above, with connDied seeing !connected: go again.
			r.pool.retract()
			return false
		}
	}
	return true
}

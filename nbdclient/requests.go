package nbdclient

import (
	"fmt"
	"slices"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// requests are the ops of calls in progress: sent, or waiting to be re-sent, and not
// yet answered (guarded by Remote.mu). An op a call gave up on leaves the set, and a
// reply that comes for it later is dropped.
type requests struct {
	seq     uint64 // submission order of the latest call's op
	pending map[*op]struct{}
}

func (q *requests) init() { q.pending = make(map[*op]struct{}) }

// submit takes in the op of a call, in submission order.
func (q *requests) submit(o *op) {
	q.seq++
	o.seq = q.seq
	q.pending[o] = struct{}{}
}

// track takes in a rewrite from the replay log, which nobody waits for.
func (q *requests) track(o *op) {
	o.fin = make(chan struct{})
	q.pending[o] = struct{}{}
}

func (q *requests) has(o *op) bool {
	_, ok := q.pending[o]
	return ok
}

func (q *requests) remove(o *op) { delete(q.pending, o) }

// inFlight is what a new pool must re-send of what the old one was sent: the writes,
// then the reads and flushes, each in submission order. The rewrites of a replay that
// failed are dropped: the log is rewritten whole again.
func (q *requests) inFlight() (writes, rest []*op) {
	for o := range q.pending {
		if o.logEntry {
			delete(q.pending, o)
			continue
		}
		if o.isWrite() {
			writes = append(writes, o)
		} else {
			rest = append(rest, o)
		}
	}
	slices.SortFunc(writes, func(a, b *op) int { return cmpU64(a.seq, b.seq) })
	slices.SortFunc(rest, func(a, b *op) int { return cmpU64(a.seq, b.seq) })
	return writes, rest
}

// stuck lists the connections with a request on the wire for longer than timeout.
// Rewrites count too: a server that stalls during a replay would otherwise hold the
// pool down for as long as it stalls.
func (q *requests) stuck(now time.Time, timeout time.Duration) []*pconn {
	var stuck []*pconn
	for o := range q.pending {
		if o.conn != nil && !o.sentAt.IsZero() && now.Sub(o.sentAt) > timeout && !slices.Contains(stuck, o.conn) {
			stuck = append(stuck, o.conn)
		}
	}
	return stuck
}

// oldest is how long the oldest call still waiting has waited.
func (q *requests) oldest(now time.Time) time.Duration {
	var d time.Duration
	for o := range q.pending {
		if !o.start.IsZero() && !o.logEntry {
			d = max(d, now.Sub(o.start))
		}
	}
	return d
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// split cuts [off, off+n) into requests of at most the export's maximum payload,
// checking the minimum block size.
func (r *Remote) split(cmd, flags uint16, p []byte, off, n int64) ([]*op, error) {
	if off < 0 || n < 0 {
		return nil, fmt.Errorf("nbd %s: negative offset or length: %w", opName(cmd), syscall.EINVAL)
	}
	exp := r.Export()
	if mb := int64(exp.MinBlock); mb > 1 && (off%mb != 0 || n%mb != 0) {
		return nil, fmt.Errorf("nbd %s [%d, +%d): not aligned to the export's %d-byte blocks: %w", opName(cmd), off, n, mb, syscall.EINVAL)
	}
	if off+n > int64(exp.Size) || off+n < off {
		return nil, fmt.Errorf("nbd %s [%d, +%d): beyond the export's %d bytes: %w", opName(cmd), off, n, exp.Size, syscall.EINVAL)
	}
	chunk := int64(exp.maxPayload())
	ops := make([]*op, 0, (n+chunk-1)/chunk)
	for done := int64(0); done < n; done += chunk {
		l := min(chunk, n-done)
		o := &op{cmd: cmd, flags: flags, off: uint64(off + done), length: uint32(l)}
		switch cmd {
		case nbdproto.CmdRead:
			o.buf = p[done : done+l]
		case nbdproto.CmdWrite:
			o.data = p[done : done+l]
		}
		ops = append(ops, o)
	}
	return ops, nil
}

// do runs ops (the pieces of one call) concurrently within the in-flight bound, and
// returns the first error once every one has finished. cancel, if not nil, ends the
// call's waits when it is closed.
func (r *Remote) do(ops []*op, cancel <-chan struct{}) error {
	now := time.Now()
	w := waiter{expire: r.deadline.expiry(), cancel: cancel}
	if b := r.opts.callBound(); b > 0 {
		w.deadline = now.Add(b)
	}
	if err := w.expired(); err != nil {
		return err
	}
	var firstErr error
	started := ops[:0:0]
	for _, o := range ops {
		o.start = now
		// Room comes back as earlier pieces are answered (finish), so a call larger
		// than the bound goes through in turns.
		weight := min(int64(max(o.length, 1)), r.opts.MaxInFlight)
		if err := r.flight.acquire(weight, w); err != nil {
			firstErr = err
			break
		}
		o.weight = weight
		if err := r.start(o, w); err != nil {
			r.flight.release(weight)
			firstErr = err
			break
		}
		started = append(started, o)
	}
	if err := r.wait(started, w); err != nil && firstErr == nil {
		firstErr = err
	}
	return firstErr
}

// start registers o and sends it, waiting (as w allows) for a connection.
func (r *Remote) start(o *op, w waiter) error {
	o.fin = make(chan struct{})
	r.mu.Lock()
	c, err := r.enqueue(o, w)
	r.mu.Unlock()
	if err != nil {
		return err
	}
	c.send(o) // a failed connection is reconnected, and o re-sent, by connDied
	return nil
}

// enqueue waits for the pool (as w allows), takes o in and picks the connection it
// goes on (r.mu held, and released while it waits).
func (r *Remote) enqueue(o *op, w waiter) (*pconn, error) {
	if err := r.awaitPool(o, w); err != nil {
		return nil, err
	}
	if r.pool.broken != nil {
		return nil, r.pool.broken
	}
	if r.closed {
		return nil, errClosed
	}
	if o.cmd == nbdproto.CmdFlush && !r.log.durable() {
		return nil, ErrDurability
	}
	r.reqs.submit(o)
	o.flushMark = r.log.flushMark()
	c := r.pool.next()
	o.conn = c
	o.sentAt = time.Now()
	return c, nil
}

// awaitPool waits, as w allows, until the pool is up, broken or closed (r.mu held, and
// released while it waits).
func (r *Remote) awaitPool(o *op, w waiter) error {
	for !r.pool.connected && r.pool.broken == nil {
		if r.closed {
			return errClosed
		}
		up, since, last := r.pool.up, r.pool.downSince, r.pool.lastErr
		r.mu.Unlock()
		tc, stop := w.timer()
		var err error
		select {
		case <-up:
		case <-r.closeCh:
		case <-tc:
			err = eio("nbd %s: server %s unreachable since %s (%v)", opName(o.cmd), r.target.Address, since.Format(time.TimeOnly), last)
		case <-w.expire:
			err = fmt.Errorf("nbd %s: server %s unreachable: %w", opName(o.cmd), r.target.Address, ErrDeadline)
		case <-w.cancel:
			err = eio("nbd %s: call canceled while the server was unreachable", opName(o.cmd))
		}
		stop()
		r.mu.Lock()
		if err != nil {
			return err
		}
	}
	return nil
}

// wait returns the first error of ops once all are answered, or EIO once w says stop.
// The requests unanswered then are abandoned together, and take their connections down
// with them, so that no reply can land in a buffer their caller has taken back and no
// late write can overtake one the caller makes next.
func (r *Remote) wait(ops []*op, w waiter) error {
	tc, stop := w.timer()
	defer stop()
	for i, o := range ops {
		var why error
		select {
		case <-o.fin:
			continue
		case <-tc:
			why = eio("nbd %s: no reply from %s within %v", opName(o.cmd), r.target.Address, r.opts.callBound())
		case <-w.expire:
			why = fmt.Errorf("nbd %s: no reply from %s: %w", opName(o.cmd), r.target.Address, ErrDeadline)
		case <-w.cancel:
			why = eio("nbd %s: call canceled", opName(o.cmd))
		}
		r.abandon(ops[i:], why)
		break
	}
	for _, o := range ops {
		if o.err != nil {
			return o.err
		}
	}
	return nil
}

// abandon fails the ops still pending with why, and closes and quiesces the
// connections they were sent on.
func (r *Remote) abandon(ops []*op, why error) {
	var conns []*pconn
	r.mu.Lock()
	for _, o := range ops {
		if !r.reqs.has(o) {
			continue
		}
		r.finish(o, why)
		if o.conn != nil && !slices.Contains(conns, o.conn) {
			conns = append(conns, o.conn)
		}
	}
	r.mu.Unlock()
	for _, c := range conns {
		c.fail(eio("nbd: request timed out"))
		c.quiesce()
	}
	// Ops finished by others meanwhile are final too: wait for the ones racing us.
	for _, o := range ops {
		<-o.fin
	}
}

// finish takes o out of the pending set with its result, and gives back its room in
// flight (r.mu held).
func (r *Remote) finish(o *op, err error) {
	r.reqs.remove(o)
	if o.weight != 0 {
		r.flight.release(o.weight)
		o.weight = 0
	}
	o.err = err
	close(o.fin)
}

// complete is the readers' callback: the server answered o.
func (r *Remote) complete(o *op, err error) {
	if o.direct {
		o.err = err
		close(o.fin)
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.reqs.has(o) {
		return // abandoned, or left over from a failed replay
	}
	if o.logEntry {
		if err != nil {
			// A rewrite of an acknowledged write failed: its data may be gone.
			r.log.rewriteFailed(o)
		}
		r.finish(o, err)
		return
	}
	if err == nil {
		switch {
		case o.isWrite():
			r.log.acked(o, r.pool.export.Flags)
		case o.cmd == nbdproto.CmdFlush:
			r.log.flushed(o.flushMark)
		}
	}
	if o.keep != nil { // a failed write
		putCopy(o.keep)
		o.keep = nil
	}
	r.finish(o, err)
}

// watchdog takes down a connection with a request that has waited RequestTimeout for
// its reply, so that the pool reconnects and re-sends it (the call itself waits on, up
// to QueueTimeout): a server that stopped answering without closing the connection is
// treated as one that closed it.
func (r *Remote) watchdog() {
	tick := min(max(r.opts.RequestTimeout/4, 5*time.Millisecond), time.Second)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-r.closeCh:
			return
		case <-t.C:
		}
		r.mu.Lock()
		stuck := r.reqs.stuck(time.Now(), r.opts.RequestTimeout)
		r.mu.Unlock()
		for _, c := range stuck {
			c.fail(eio("nbd: no reply from %s within %v", r.target.Address, r.opts.RequestTimeout))
		}
	}
}

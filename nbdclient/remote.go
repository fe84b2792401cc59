package nbdclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// Options tune a Remote. The zero value is usable: every zero field takes its default.
type Options struct {
	// TLS replaces the TLS settings built from the URI (nbds:// only).
	TLS *tls.Config
	// DialTimeout bounds one connect and handshake (default 10s).
	DialTimeout time.Duration
	// RequestTimeout bounds a request's wait for its reply once it is on the wire
	// (default 30s). A request that outlives it takes its connection down, as a broken
	// one would: the pool reconnects and re-sends it, if its call may still wait
	// (QueueTimeout), and fails it with EIO otherwise.
	RequestTimeout time.Duration
	// QueueTimeout bounds a call in all: its waits for a connection, for room in flight
	// and for replies, across reconnections, which is how long a call may be held while
	// the server is away (dm-multipath's no_path_retry, open-iscsi's replacement_timeout).
	// A call that runs out fails with EIO. Zero (the default) is RequestTimeout: a call
	// fails once its request does. Forever holds calls until the server answers, or
	// until Close or SetDeadline (dm-multipath's queue_if_no_path).
	QueueTimeout time.Duration
	// Conns is how many connections to open when the server advertises
	// NBD_FLAG_CAN_MULTI_CONN (default 4; one otherwise).
	Conns int
	// MaxInFlight bounds the bytes of requests on the wire at once (default 64 MiB).
	MaxInFlight int64
	// ReplayLimit bounds the copies kept of acknowledged but not yet flushed writes, to
	// rewrite them after a reconnection (default 64 MiB; negative keeps none).
	ReplayLimit int64
	// BackoffMin and BackoffMax bound the wait between reconnection attempts, which
	// doubles from the first to the second (defaults 50ms and 2s).
	BackoffMin, BackoffMax time.Duration
	// SimpleReplies does not ask for structured replies.
	SimpleReplies bool
	// Logf, when set, is told of lost connections and reconnections.
	Logf func(format string, args ...any)
	// Verify, when set, checks every new pool of connections before anything is
	// re-sent on it, reading through read (which goes to the new server only): that the
	// export is still the one the caller was using, say, so that writes it had
	// acknowledged are not replayed onto another volume. An error stops the Remote for
	// good: every call then fails with it (wrapped with ErrExportChanged), and nothing
	// more is sent.
	Verify func(read func(p []byte, off int64) error) error
}

// Forever, as Options.QueueTimeout, holds calls for as long as the server is away.
const Forever time.Duration = -1

// callBound is how long a call may wait in all; 0 means without end.
func (o *Options) callBound() time.Duration {
	if o.QueueTimeout < 0 {
		return 0
	}
	return max(o.QueueTimeout, o.RequestTimeout)
}

// requeues reports whether a request that outlived RequestTimeout is re-sent on a new
// connection rather than failed with its call.
func (o *Options) requeues() bool { return o.QueueTimeout < 0 || o.QueueTimeout > o.RequestTimeout }

func (o *Options) fill() {
	def := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.DialTimeout, 10*time.Second)
	def(&o.RequestTimeout, 30*time.Second)
	def(&o.BackoffMin, 50*time.Millisecond)
	def(&o.BackoffMax, 2*time.Second)
	if o.Conns <= 0 {
		o.Conns = 4
	}
	if o.MaxInFlight <= 0 {
		o.MaxInFlight = 64 << 20
	}
	if o.ReplayLimit == 0 {
		o.ReplayLimit = 64 << 20
	}
}

var (
	errClosed = errors.New("nbd: client closed")
	// ErrDurability is what a Sync returns when a reconnection may have lost writes that
	// had been acknowledged but not flushed and were not kept for replay.
	ErrDurability = fmt.Errorf("nbd flush: reconnected to the server, and writes it acknowledged before were neither flushed nor kept for replay: %w", syscall.EIO)
	// ErrExportChanged is what every call returns once Options.Verify refused a new
	// connection's export.
	ErrExportChanged = fmt.Errorf("nbd: the export is not the one this client was using: %w", syscall.EIO)
	// ErrDeadline is what calls return once the deadline SetDeadline gave has passed.
	ErrDeadline = fmt.Errorf("nbd: deadline passed: %w", syscall.EIO)
)

// eio wraps why a request failed with EIO, so errors.Is(err, syscall.EIO) holds.
func eio(format string, a ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, a...), syscall.EIO)
}

// Remote is an NBD export as random-access storage (the method set of eli's
// provider.Provider and provider.Puncher). It is safe for concurrent use: requests from
// all callers are pipelined over one or more connections, and a lost connection is
// re-established (see the package documentation for what is re-sent and in what order).
type Remote struct {
	target Target
	opts   Options
	tlsCfg *tls.Config
	size   atomic.Int64

	mu         sync.Mutex
	conns      []*pconn
	export     Export
	gen        uint64
	connected  bool
	up         chan struct{} // closed while connected
	closed     bool
	closeCh    chan struct{}
	ctx        context.Context // canceled by Close, to stop a dial in progress
	cancel     context.CancelFunc
	rr         uint64
	seq        uint64
	ackSeq     uint64
	pending    map[*op]struct{} // sent (or to be re-sent) and not yet answered
	log        []*op            // acknowledged, not yet flushed writes, in ackSeq order
	logBytes   int64
	unkept     unkeptSpans // acknowledged, not flushed, not in the log
	lost       lostSpans   // data a reconnection may have lost: flushes fail until rewritten
	redials    int         // reconnections made (for tests and messages)
	reconnDone chan struct{}
	broken     error         // Verify refused the export: every call fails with it
	downSince  time.Time     // when the pool went down (zero while connected)
	lastErr    error         // why it went down, or the last dial's failure since
	expire     chan struct{} // closed once the SetDeadline deadline has passed
	expireAt   time.Time
	expireT    *time.Timer

	flightMu   sync.Mutex
	flightCond *sync.Cond
	inFlight   int64
}

// Open connects to the export an NBD URI names (ParseURI). opts may be nil.
func Open(uri string, opts *Options) (*Remote, error) {
	t, err := ParseURI(uri)
	if err != nil {
		return nil, err
	}
	return OpenTarget(t, opts)
}

// OpenTarget connects to t. The first connection is not retried: an unreachable server
// is an error here, while later losses are reconnected.
func OpenTarget(t Target, opts *Options) (*Remote, error) {
	r := &Remote{target: t, pending: make(map[*op]struct{}), closeCh: make(chan struct{}), expire: make(chan struct{})}
	r.ctx, r.cancel = context.WithCancel(context.Background())
	if opts != nil {
		r.opts = *opts
	}
	r.opts.fill()
	r.flightCond = sync.NewCond(&r.flightMu)
	if t.TLS {
		r.tlsCfg = r.opts.TLS
		if r.tlsCfg == nil {
			cfg, err := t.tlsConfig()
			if err != nil {
				return nil, err
			}
			r.tlsCfg = cfg
		}
	}
	r.gen = 1
	conns, exp, err := r.dialPool(r.gen)
	if err != nil {
		r.cancel()
		return nil, err
	}
	r.mu.Lock()
	r.conns, r.export, r.connected = conns, exp, true
	r.up = make(chan struct{})
	close(r.up)
	r.size.Store(int64(exp.Size))
	r.mu.Unlock()
	// A connection that failed before the pool was up found nobody to reconnect it.
	for _, c := range conns {
		if err := c.failed(); err != nil {
			r.connDied(c, err)
			break
		}
	}
	if r.opts.requeues() {
		go r.watchdog()
	}
	return r, nil
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
		// Replayed writes count too: a server that stalls during a replay would
		// otherwise hold the pool down for as long as it stalls.
		var stuck []*pconn
		now := time.Now()
		r.mu.Lock()
		for o := range r.pending {
			if o.conn != nil && !o.sentAt.IsZero() && now.Sub(o.sentAt) > r.opts.RequestTimeout && !slices.Contains(stuck, o.conn) {
				stuck = append(stuck, o.conn)
			}
		}
		r.mu.Unlock()
		for _, c := range stuck {
			c.fail(eio("nbd: no reply from %s within %v", r.target.Address, r.opts.RequestTimeout))
		}
	}
}

// SetDeadline bounds every call, in progress or to come, by t: from t on they fail with
// ErrDeadline (an EIO) instead of waiting for the server, whatever QueueTimeout says.
// It is for a caller that must stop within a bound (a server shutting down). A later
// call moves the deadline; the zero time removes it.
func (r *Remote) SetDeadline(t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.expireT != nil {
		r.expireT.Stop()
		r.expireT = nil
	}
	select {
	case <-r.expire:
		r.expire = make(chan struct{}) // passed before: a new one
	default:
	}
	r.expireAt = t
	if t.IsZero() {
		return
	}
	ch := r.expire
	r.expireT = time.AfterFunc(time.Until(t), func() {
		close(ch)
		// Wake calls that wait for room in flight.
		r.flightMu.Lock()
		r.flightCond.Broadcast()
		r.flightMu.Unlock()
	})
}

// expiry is the channel closed once the SetDeadline deadline has passed.
func (r *Remote) expiry() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.expire
}

// Health is the state of a Remote's connections, for status reports.
type Health struct {
	Connected     bool
	DownSince     time.Time     // when the connections were lost (zero while connected)
	LastError     error         // why, or the last failed attempt to reconnect since
	Reconnections int           // connections re-established after a loss
	Oldest        time.Duration // how long the oldest request in flight has waited
	Broken        error         // Verify refused the export (ErrExportChanged)
}

// Health reports the state of the connections.
func (r *Remote) Health() Health {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := Health{Connected: r.connected && r.broken == nil, DownSince: r.downSince, LastError: r.lastErr,
		Reconnections: r.redials, Broken: r.broken}
	now := time.Now()
	for o := range r.pending {
		if !o.start.IsZero() && !o.logEntry {
			h.Oldest = max(h.Oldest, now.Sub(o.start))
		}
	}
	return h
}

func (r *Remote) dialOne(gen uint64) (*pconn, Export, error) {
	ctx, cancel := context.WithTimeout(r.ctx, r.opts.DialTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(ctx, r.target.Network, r.target.Address)
	if err != nil {
		return nil, Export{}, fmt.Errorf("connect to NBD server %s: %w", r.target.Address, err)
	}
	n, err := negotiate(ctx, nc, handshakeConfig{name: r.target.Export, tls: r.tlsCfg, structured: !r.opts.SimpleReplies})
	if err != nil {
		nc.Close()
		return nil, Export{}, err
	}
	return newPconn(n, gen, r.opts.RequestTimeout, r.complete, r.connDied), n.export, nil
}

// dialPool opens the first connection, and more when the export allows multi-conn (a
// FLUSH on one then covers writes completed on all, proto.md NBD_FLAG_CAN_MULTI_CONN).
func (r *Remote) dialPool(gen uint64) ([]*pconn, Export, error) {
	c, exp, err := r.dialOne(gen)
	if err != nil {
		return nil, Export{}, err
	}
	conns := []*pconn{c}
	if exp.Flags&nbdproto.TflagCanMultiConn != 0 {
		for len(conns) < r.opts.Conns {
			c, e2, err := r.dialOne(gen)
			if err != nil || e2.Flags != exp.Flags || e2.Size != exp.Size {
				if err == nil {
					c.disconnect()
				}
				break // fewer connections still work
			}
			conns = append(conns, c)
		}
	}
	return conns, exp, nil
}

// Refresh asks the server for the export's size again and, if it changed (an export
// grown on the storage side), reconnects so that requests may use the new size (servers
// bound requests by the size they announced on each connection). It returns the size.
func (r *Remote) Refresh() (int64, error) {
	c, exp, err := r.dialOne(0)
	if err != nil {
		return 0, err
	}
	c.disconnect()
	if int64(exp.Size) == r.Size() {
		return r.Size(), nil
	}
	r.mu.Lock()
	var cur *pconn
	if r.connected {
		cur = r.conns[0]
	}
	up := r.up
	r.mu.Unlock()
	if cur != nil {
		cur.fail(errRefresh)
	}
	t := time.NewTimer(r.opts.RequestTimeout)
	defer t.Stop()
	for {
		select {
		case <-up:
		case <-t.C:
			return r.Size(), eio("nbd: reconnecting for the new export size timed out")
		case <-r.closeCh:
			return r.Size(), errClosed
		}
		r.mu.Lock()
		connected, u := r.connected, r.up
		r.mu.Unlock()
		if connected {
			return r.Size(), nil
		}
		up = u
	}
}

var errRefresh = errors.New("nbd: reconnecting for a new export size")

// Export is what the server said about the export on the current connection.
func (r *Remote) Export() Export {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.export
}

// Target is where the Remote connects.
func (r *Remote) Target() Target { return r.target }

// String names the export as a URI (for messages).
func (r *Remote) String() string { return r.target.String() }

// Size is the export's size in bytes, as of the latest (re)connection.
func (r *Remote) Size() int64 { return r.size.Load() }

// Conns is how many connections are open.
func (r *Remote) Conns() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.conns)
}

// Reconnections counts the connections re-established after a loss.
func (r *Remote) Reconnections() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.redials
}

// acquire waits for n bytes of room in flight.
func (r *Remote) acquire(n int64, w waiter) error {
	r.flightMu.Lock()
	defer r.flightMu.Unlock()
	if r.inFlight+n <= r.opts.MaxInFlight {
		r.inFlight += n
		return nil
	}
	// Wake on every release, once at the deadline, and when the call is canceled (the
	// SetDeadline timer wakes us itself).
	wake := func() {
		r.flightMu.Lock()
		r.flightCond.Broadcast()
		r.flightMu.Unlock()
	}
	if !w.deadline.IsZero() {
		t := time.AfterFunc(time.Until(w.deadline), wake)
		defer t.Stop()
	}
	if w.cancel != nil {
		stop := make(chan struct{})
		defer close(stop)
		go func() {
			select {
			case <-w.cancel:
				wake()
			case <-stop:
			}
		}()
	}
	for r.inFlight+n > r.opts.MaxInFlight {
		if err := w.expired(); err != nil {
			return fmt.Errorf("nbd: waiting for room in flight: %w", err)
		}
		r.flightCond.Wait()
	}
	r.inFlight += n
	return nil
}

// waiter is what bounds one call's waits: its own deadline (zero: none), the Remote's
// SetDeadline, and its caller's cancellation (nil: none).
type waiter struct {
	deadline time.Time
	expire   <-chan struct{}
	cancel   <-chan struct{}
}

// expired reports why the call must stop waiting, or nil.
func (w waiter) expired() error {
	select {
	case <-w.expire:
		return ErrDeadline
	case <-w.cancel:
		return eio("nbd: call canceled")
	default:
	}
	if !w.deadline.IsZero() && !time.Now().Before(w.deadline) {
		return eio("nbd: timed out")
	}
	return nil
}

// timer fires at the call's deadline; its channel is nil (never ready) without one.
func (w waiter) timer() (<-chan time.Time, func()) {
	if w.deadline.IsZero() {
		return nil, func() {}
	}
	t := time.NewTimer(time.Until(w.deadline))
	return t.C, func() { t.Stop() }
}

func (r *Remote) release(n int64) {
	r.flightMu.Lock()
	r.inFlight -= n
	r.flightCond.Broadcast()
	r.flightMu.Unlock()
}

// start registers o and sends it, waiting (as w allows) for a connection.
func (r *Remote) start(o *op, w waiter) error {
	o.fin = make(chan struct{})
	r.mu.Lock()
	for !r.connected && r.broken == nil {
		if r.closed {
			r.mu.Unlock()
			return errClosed
		}
		up, since, last := r.up, r.downSince, r.lastErr
		r.mu.Unlock()
		tc, stop := w.timer()
		select {
		case <-up:
		case <-r.closeCh:
		case <-tc:
			stop()
			return eio("nbd %s: server %s unreachable since %s (%v)", opName(o.cmd), r.target.Address, since.Format(time.TimeOnly), last)
		case <-w.expire:
			stop()
			return fmt.Errorf("nbd %s: server %s unreachable: %w", opName(o.cmd), r.target.Address, ErrDeadline)
		case <-w.cancel:
			stop()
			return eio("nbd %s: call canceled while the server was unreachable", opName(o.cmd))
		}
		stop()
		r.mu.Lock()
	}
	if r.broken != nil {
		err := r.broken
		r.mu.Unlock()
		return err
	}
	if r.closed {
		r.mu.Unlock()
		return errClosed
	}
	if o.cmd == nbdproto.CmdFlush && len(r.lost) > 0 {
		r.mu.Unlock()
		return ErrDurability
	}
	r.seq++
	o.seq = r.seq
	o.flushMark = r.ackSeq
	r.pending[o] = struct{}{}
	c := r.conns[r.rr%uint64(len(r.conns))]
	r.rr++
	o.conn = c
	o.sentAt = time.Now()
	r.mu.Unlock()
	c.send(o) // a failed connection is reconnected, and o re-sent, by connDied
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
		if _, ok := r.pending[o]; !ok {
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
	delete(r.pending, o)
	if o.weight != 0 {
		r.release(o.weight)
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
	if _, ok := r.pending[o]; !ok {
		return // abandoned, or left over from a failed replay
	}
	if o.logEntry {
		if err != nil {
			// A rewrite of an acknowledged write failed: its data may be gone.
			r.lost.add(o.off, o.off+uint64(o.length))
		}
		r.finish(o, err)
		return
	}
	if err == nil {
		switch {
		case o.isWrite():
			if o.cmd != nbdproto.CmdTrim {
				r.lost.rewritten(o.off, o.off+uint64(o.length))
			}
			r.ackSeq++
			o.ackSeq = r.ackSeq
			r.retain(o)
		case o.cmd == nbdproto.CmdFlush:
			r.flushed(o.flushMark)
		}
	}
	if o.keep != nil { // a failed write
		putCopy(o.keep)
		o.keep = nil
	}
	r.finish(o, err)
}

// retain keeps an acknowledged write for replay until a FLUSH covers it (r.mu held).
func (r *Remote) retain(o *op) {
	keep := o.keep
	o.keep = nil
	if r.export.Flags&nbdproto.TflagSendFlush == 0 || o.flags&nbdproto.CmdFlagFUA != 0 {
		putCopy(keep)
		return // durable once acknowledged
	}
	cost := logEntryCost + int64(len(keep))
	if (o.cmd == nbdproto.CmdWrite && keep == nil) || r.logBytes+cost > r.opts.ReplayLimit {
		putCopy(keep)
		r.unkept.add(span{off: o.off, end: o.off + uint64(o.length), ackSeq: o.ackSeq})
		return
	}
	e := &op{cmd: o.cmd, flags: o.flags, off: o.off, length: o.length, data: keep, ackSeq: o.ackSeq, logEntry: true}
	r.log = append(r.log, e)
	r.logBytes += cost
}

// logEntryCost is what a replay log entry costs beside its data, so that trims and
// zeroes count against ReplayLimit too.
const logEntryCost = 128

// flushed drops the log entries a successful FLUSH covered (r.mu held).
func (r *Remote) flushed(mark uint64) {
	i := 0
	for i < len(r.log) && r.log[i].ackSeq <= mark {
		r.logBytes -= logEntryCost + int64(len(r.log[i].data))
		putCopy(r.log[i].data)
		r.log[i] = nil
		i++
	}
	r.log = r.log[i:]
	r.unkept.flushed(mark)
}

// connDied is the connections' callback: take the pool down and reconnect.
func (r *Remote) connDied(c *pconn, err error) {
	r.mu.Lock()
	if r.closed || c.gen != r.gen || !r.connected {
		r.mu.Unlock()
		return // already being handled (or a replay is watching it)
	}
	r.connected = false
	r.up = make(chan struct{})
	r.downSince, r.lastErr = time.Now(), err
	old := r.conns
	done := make(chan struct{})
	r.reconnDone = done
	r.mu.Unlock()
	for _, oc := range old {
		oc.fail(err)
	}
	r.logf("nbd: lost the connection to %s (%v); reconnecting", r.target.Address, err)
	go r.reconnect(old, done)
}

// reconnect redials with backoff until it succeeds or the Remote closes, then replays.
func (r *Remote) reconnect(old []*pconn, done chan struct{}) {
	defer close(done)
	backoff := r.opts.BackoffMin
	for {
		// No reader of a dead connection may touch an op once it is re-sent.
		for _, c := range old {
			c.quiesce()
		}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			return
		}
		r.gen++
		gen := r.gen
		r.mu.Unlock()
		conns, exp, err := r.dialPool(gen)
		if err == nil && r.opts.Verify != nil {
			if verr := r.verify(conns); verr != nil {
				for _, c := range conns {
					c.disconnect()
				}
				if !errors.Is(verr, errVerifyIO) {
					r.stop(verr)
					return
				}
				err = verr // the new connection failed: try again
			}
		}
		if err != nil {
			r.mu.Lock()
			r.lastErr = err
			r.mu.Unlock()
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-r.closeCh:
				t.Stop()
				return
			}
			backoff = min(2*backoff, r.opts.BackoffMax)
			old = nil
			continue
		}
		if r.replay(conns, exp) {
			r.logf("nbd: reconnected to %s", r.target.Address)
			return
		}
		for _, c := range conns {
			c.fail(eio("nbd: connection lost during replay"))
		}
		old = conns
	}
}

// replay re-sends, on fresh connections, first the log of acknowledged unflushed writes
// in acknowledgement order, then the writes that were in flight in submission order, a
// write never sent while an overlapping one is still unanswered; then the reads and
// flushes in flight. Only then may new requests go. It reports whether the pool is up.
func (r *Remote) replay(conns []*pconn, exp Export) bool {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		for _, c := range conns {
			c.disconnect()
		}
		return true
	}
	r.conns, r.export = conns, exp
	r.size.Store(int64(exp.Size))
	r.redials++
	for _, u := range r.unkept {
		r.lost.add(u.off, u.end)
	}
	r.unkept = r.unkept[:0]
	var writes, rest []*op
	for o := range r.pending {
		if o.logEntry {
			delete(r.pending, o) // a replay that failed: the log is replayed whole again
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
	writes = append(slices.Clone(r.log), writes...)
	r.mu.Unlock()

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
			if _, ok := r.pending[o]; !ok { // abandoned by its caller meanwhile
				r.mu.Unlock()
				continue
			}
			// From here its caller, should it give up, closes c and waits for c's
			// writer (quiesce) before taking its buffer back.
		} else {
			o.fin = make(chan struct{})
			r.pending[o] = struct{}{}
		}
		c := conns[i%len(conns)]
		o.conn, o.covered, o.serr, o.sentAt = c, 0, nil, time.Now()
		r.mu.Unlock()
		if c.send(o) != nil {
			return false
		}
		inFlight = append(inFlight, o)
	}
	if !drain() {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, o := range rest {
		if _, ok := r.pending[o]; !ok {
			continue
		}
		if o.cmd == nbdproto.CmdFlush {
			if len(r.lost) > 0 {
				r.finish(o, ErrDurability)
				continue
			}
			o.flushMark = r.ackSeq
		}
		c := conns[i%len(conns)]
		o.conn, o.covered, o.serr, o.sentAt = c, 0, nil, time.Now()
		// Sending under r.mu keeps new requests behind these; a failure here is
		// handled by connDied once the pool is marked up.
		go c.send(o)
	}
	r.connected = true
	r.downSince, r.lastErr = time.Time{}, nil
	close(r.up)
	for _, c := range conns {
		if c.failed() != nil {
			// Died after the check above, with connDied seeing !connected: go again.
			r.connected = false
			r.up = make(chan struct{})
			return false
		}
	}
	return true
}

// errVerifyIO marks a Verify that could not read (the new connection failed too), as
// opposed to one that refused what it read.
var errVerifyIO = errors.New("nbd: verify read failed")

// verify runs Options.Verify on a new pool, reading through its first connection.
func (r *Remote) verify(conns []*pconn) error {
	read := func(p []byte, off int64) error {
		if off < 0 || uint64(off)+uint64(len(p)) > uint64(r.Size()) || len(p) > 32<<20 {
			return fmt.Errorf("nbd: verify read [%d, +%d) outside the export", off, len(p))
		}
		o := &op{cmd: nbdproto.CmdRead, off: uint64(off), length: uint32(len(p)), buf: p, direct: true, fin: make(chan struct{})}
		c := conns[0]
		if err := c.send(o); err != nil {
			return fmt.Errorf("%w: %v", errVerifyIO, err)
		}
		t := time.NewTimer(r.opts.RequestTimeout)
		defer t.Stop()
		select {
		case <-o.fin:
			if o.err != nil {
				return fmt.Errorf("%w: %v", errVerifyIO, o.err)
			}
			return nil
		case <-c.readerDone:
		case <-t.C:
		}
		c.fail(eio("nbd: verify read timed out"))
		c.quiesce()
		return fmt.Errorf("%w: no reply", errVerifyIO)
	}
	if err := r.opts.Verify(read); err != nil {
		if errors.Is(err, errVerifyIO) {
			return err
		}
		r.logf("nbd: %s: %v: stopping", r.target.Address, err)
		return fmt.Errorf("%w: %v", ErrExportChanged, err)
	}
	return nil
}

// stop ends the Remote for good after Verify refused the export: every call pending
// or to come fails with err, and nothing is re-sent (acknowledged, unflushed writes
// are lost with the export they went to; flushes fail).
func (r *Remote) stop(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.broken, r.lastErr = err, err
	for o := range r.pending {
		if o.logEntry {
			delete(r.pending, o)
			continue
		}
		r.finish(o, err)
	}
	r.log, r.logBytes = nil, 0
	close(r.up) // wake the calls waiting for a connection: they find r.broken
}

func (r *Remote) logf(format string, args ...any) {
	if r.opts.Logf != nil {
		r.opts.Logf(format, args...)
	}
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

// do runs ops (the pieces of one call) concurrently within the in-flight bound, and
// returns the first error once every one has finished. cancel, if not nil, ends the
// call's waits when it is closed.
func (r *Remote) do(ops []*op, cancel <-chan struct{}) error {
	now := time.Now()
	w := waiter{expire: r.expiry(), cancel: cancel}
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
		if err := r.acquire(weight, w); err != nil {
			firstErr = err
			break
		}
		o.weight = weight
		if err := r.start(o, w); err != nil {
			r.release(weight)
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

// split cuts [off, off+n) into requests of at most the export's maximum payload,
// checking the minimum block size.
func (r *Remote) split(cmd, flags uint16, p []byte, off, n int64) ([]*op, error) {
	if off < 0 || n < 0 {
		return nil, fmt.Errorf("nbd %s: negative offset or length: %w", opName(cmd), syscall.EINVAL)
	}
	r.mu.Lock()
	exp := r.export
	r.mu.Unlock()
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

// ReadAt reads len(p) bytes at off; past the end of the export it reads what there is
// and returns io.EOF.
func (r *Remote) ReadAt(p []byte, off int64) (int, error) { return r.readAt(p, off, nil) }

// ReadAtContext is ReadAt, ending its waits with ctx (EIO when ctx ends first).
func (r *Remote) ReadAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	return r.readAt(p, off, ctx.Done())
}

// WriteAtContext is WriteAt, ending its waits with ctx.
func (r *Remote) WriteAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	return r.write(p, off, 0, ctx.Done())
}

// SyncContext is Sync, ending its wait with ctx.
func (r *Remote) SyncContext(ctx context.Context) error { return r.sync(ctx.Done()) }

func (r *Remote) readAt(p []byte, off int64, cancel <-chan struct{}) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("nbd read: negative offset: %w", syscall.EINVAL)
	}
	n := int64(len(p))
	eof := false
	if size := r.Size(); off+n > size {
		n, eof = max(size-off, 0), true
	}
	ops, err := r.split(nbdproto.CmdRead, 0, p, off, n)
	if err != nil {
		return 0, err
	}
	if err := r.do(ops, cancel); err != nil {
		return 0, err
	}
	if eof {
		return int(n), io.EOF
	}
	return int(n), nil
}

// WriteAt writes p at off.
func (r *Remote) WriteAt(p []byte, off int64) (int, error) { return r.write(p, off, 0, nil) }

// WriteAtFUA writes p at off, durable before it returns (NBD_CMD_FLAG_FUA where the
// server takes it, else a FLUSH after the write).
func (r *Remote) WriteAtFUA(p []byte, off int64) (int, error) {
	if r.Export().Flags&nbdproto.TflagSendFUA == 0 {
		if n, err := r.write(p, off, 0, nil); err != nil {
			return n, err
		}
		return len(p), r.Sync()
	}
	return r.write(p, off, nbdproto.CmdFlagFUA, nil)
}

func (r *Remote) write(p []byte, off int64, flags uint16, cancel <-chan struct{}) (int, error) {
	if r.Export().Flags&nbdproto.TflagReadOnly != 0 {
		return 0, fmt.Errorf("nbd write: export is read-only: %w", syscall.EPERM)
	}
	ops, err := r.split(nbdproto.CmdWrite, flags, p, off, int64(len(p)))
	if err != nil {
		return 0, err
	}
	if r.keepsWrites() && flags&nbdproto.CmdFlagFUA == 0 {
		for _, o := range ops {
			o.keep = getCopy(o.data)
		}
	}
	if err := r.do(ops, cancel); err != nil {
		return 0, err
	}
	return len(p), nil
}

// keepsWrites reports whether writes are copied for the replay log.
func (r *Remote) keepsWrites() bool {
	if r.opts.ReplayLimit < 0 {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.export.Flags&nbdproto.TflagSendFlush != 0 && r.logBytes < r.opts.ReplayLimit
}

// Sync makes every completed write durable: it returns nil only after the server
// acknowledged an NBD_CMD_FLUSH sent after them (or, for a server that takes no flushes,
// at once: its writes are durable when acknowledged).
func (r *Remote) Sync() error { return r.sync(nil) }

func (r *Remote) sync(cancel <-chan struct{}) error {
	if r.Export().Flags&nbdproto.TflagSendFlush == 0 {
		return nil
	}
	return r.do([]*op{{cmd: nbdproto.CmdFlush}}, cancel)
}

// Punch makes [off, off+n) read as zeroes: NBD_CMD_WRITE_ZEROES (which lets the server
// punch a hole) where the export takes it, else written zeroes.
func (r *Remote) Punch(off, n int64) error {
	if n <= 0 {
		return nil
	}
	if r.Export().Flags&nbdproto.TflagSendWriteZeroes == 0 {
		zero := make([]byte, min(n, 1<<20))
		for n > 0 {
			l := min(n, int64(len(zero)))
			if _, err := r.WriteAt(zero[:l], off); err != nil {
				return err
			}
			off, n = off+l, n-l
		}
		return nil
	}
	ops, err := r.split(nbdproto.CmdWriteZeroes, 0, nil, off, n)
	if err != nil {
		return err
	}
	return r.do(ops, nil)
}

// Trim tells the server [off, off+n) is unused (NBD_CMD_TRIM); its contents are
// unspecified afterwards. A server that takes no trims ignores it.
func (r *Remote) Trim(off, n int64) error {
	if n <= 0 || r.Export().Flags&nbdproto.TflagSendTrim == 0 {
		return nil
	}
	ops, err := r.split(nbdproto.CmdTrim, 0, nil, off, n)
	if err != nil {
		return err
	}
	return r.do(ops, nil)
}

// Close disconnects. Calls in progress fail.
func (r *Remote) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	close(r.closeCh)
	r.cancel()
	conns := r.conns
	done := r.reconnDone
	r.mu.Unlock()
	// Readers first: once they are gone, no reply can land in a caller's buffer.
	for _, c := range conns {
		c.disconnect()
	}
	if done != nil {
		<-done
	}
	r.mu.Lock()
	for o := range r.pending {
		r.finish(o, errClosed)
	}
	r.mu.Unlock()
	return nil
}

package nbdclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// pool is the connections of the current generation and what is known of them across
// losses (guarded by Remote.mu).
type pool struct {
	conns      []*pconn
	export     Export
	gen        uint64 // conns' generation: a connection of another is not the pool's
	connected  bool
	up         chan struct{} // closed while connected (or broken)
	rr         uint64        // the next connection, round robin
	redials    int           // reconnections made (for tests and messages)
	reconnDone chan struct{} // closed when the reconnection under way ends
	broken     error         // Verify refused the export: every call fails with it
	downSince  time.Time     // when the pool went down (zero while connected)
	lastErr    error         // why it went down, or the last dial's failure since
}

// start makes the first connections the pool.
func (p *pool) start(conns []*pconn, exp Export) {
	p.conns, p.export, p.connected = conns, exp, true
	p.up = make(chan struct{})
	close(p.up)
}

// next is the connection the next request goes on.
func (p *pool) next() *pconn {
	c := p.conns[p.rr%uint64(len(p.conns))]
	p.rr++
	return c
}

// lose takes the pool down after one of conns failed with err; it returns the
// connections to close and the channel the reconnection closes when it ends, or ok
// false if c is not the pool's (a loss already being handled).
func (p *pool) lose(c *pconn, err error) (old []*pconn, done chan struct{}, ok bool) {
	if c.gen != p.gen || !p.connected {
		return nil, nil, false
	}
	p.connected = false
	p.up = make(chan struct{})
	p.downSince, p.lastErr = time.Now(), err
	p.reconnDone = make(chan struct{})
	return p.conns, p.reconnDone, true
}

// nextGen is the generation of the connections dialed next.
func (p *pool) nextGen() uint64 {
	p.gen++
	return p.gen
}

// adopt makes a new pool's connections the pool's, before the replay.
func (p *pool) adopt(conns []*pconn, exp Export) {
	p.conns, p.export = conns, exp
	p.redials++
}

// markUp opens the pool to new requests once the replay is done.
func (p *pool) markUp() {
	p.connected = true
	p.downSince, p.lastErr = time.Time{}, nil
	close(p.up)
}

// retract closes the pool again: a connection died during markUp, and the
// reconnection goes on.
func (p *pool) retract() {
	p.connected = false
	p.up = make(chan struct{})
}

// breakFor stops the pool for good: err is every call's answer from now on.
func (p *pool) breakFor(err error) {
	p.broken, p.lastErr = err, err
	close(p.up) // wake the calls waiting for a connection: they find broken
}

func (p *pool) health() Health {
	return Health{Connected: p.connected && p.broken == nil, DownSince: p.downSince, LastError: p.lastErr,
		Reconnections: p.redials, Broken: p.broken}
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

// connDied is the connections' callback: take the pool down and reconnect.
func (r *Remote) connDied(c *pconn, err error) {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	old, done, ok := r.pool.lose(c, err)
	r.mu.Unlock()
	if !ok {
		return // already being handled (or a replay is watching it)
	}
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
		gen := r.pool.nextGen()
		r.mu.Unlock()
		conns, exp, err := r.dialPool(gen)
		if err == nil {
			if err = r.verify(conns); err != nil && !errors.Is(err, errVerifyIO) {
				r.stop(err)
				return
			}
		}
		if err != nil {
			if !r.backOff(err, backoff) {
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

// backOff records why a reconnection failed and waits d before the next; false means
// the Remote closed meanwhile.
func (r *Remote) backOff(err error, d time.Duration) bool {
	r.mu.Lock()
	r.pool.lastErr = err
	r.mu.Unlock()
	t := time.NewTimer(d)
	select {
	case <-t.C:
		return true
	case <-r.closeCh:
		t.Stop()
		return false
	}
}

// errVerifyIO marks a Verify that could not read (the new connection failed too), as
// opposed to one that refused what it read.
var errVerifyIO = errors.New("nbd: verify read failed")

// verify runs Options.Verify, if set, on a new pool, reading through its first
// connection; it disconnects the pool if the check fails either way.
func (r *Remote) verify(conns []*pconn) error {
	if r.opts.Verify == nil {
		return nil
	}
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
	err := r.opts.Verify(read)
	if err == nil {
		return nil
	}
	for _, c := range conns {
		c.disconnect()
	}
	if errors.Is(err, errVerifyIO) {
		return err
	}
	r.logf("nbd: %s: %v: stopping", r.target.Address, err)
	return fmt.Errorf("%w: %v", ErrExportChanged, err)
}

// stop ends the Remote for good after Verify refused the export: every call pending
// or to come fails with err, and nothing is re-sent (acknowledged, unflushed writes
// are lost with the export they went to; flushes fail).
func (r *Remote) stop(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pool.breakFor(err)
	for o := range r.reqs.pending {
		if o.logEntry {
			r.reqs.remove(o)
			continue
		}
		r.finish(o, err)
	}
	r.log.drop()
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
	if r.pool.connected {
		cur = r.pool.conns[0]
	}
	up := r.pool.up
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
		connected, u := r.pool.connected, r.pool.up
		r.mu.Unlock()
		if connected {
			return r.Size(), nil
		}
		up = u
	}
}

var errRefresh = errors.New("nbd: reconnecting for a new export size")

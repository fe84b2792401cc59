package nbd

import "sync"

// limiter bounds what requests in flight may hold: a number of requests and a number of
// payload bytes. The reader goroutine of a connection blocks in acquire, and stops reading
// the socket: backpressure reaches the client through the transport instead of through
// memory.
//
// The server-wide limiter also keeps a small reserve for each connection (see reserve):
// a request that fits in its connection's reserve never waits for the shared pool, so
// connections that fill the shared pool (by sending a WRITE header and no payload, or by
// not reading their replies) cannot stall the small requests of everyone else. A request
// larger than a reserve never waits for the shared pool either: it takes it if it has
// room now (tryAcquire), and is otherwise served in pieces under its connection's reserve
// (stream.go). So the only waiters in the queue are requests of up to a reserve, each of
// which its own reserve can hold once its own connection's earlier requests are done:
// what others hold delays no one's request, whatever its size. The shared pool is granted
// in FIFO order, and since a connection reads one request at a time it has at most one
// waiter in the queue.
type limiter struct {
	mu    sync.Mutex
	total int // slots, free or not
	slots int
	bytes int64
	queue []*waiter
}

// reserve is one connection's private share of the server-wide limiter; its fields are
// guarded by that limiter's mu.
type reserve struct {
	slots int
	bytes int64
}

// Each connection in transmission may hold this much outside the shared pool: enough for
// a few requests of the sizes a kernel or a copying tool sends (a 4 KiB page to 1 MiB).
// The memory bound of the server is then MaxBytes + MaxConns × reserveBytes.
const (
	reserveSlots = 8
	reserveBytes = 1 << 20
)

func newReserve() *reserve { return &reserve{slots: reserveSlots, bytes: reserveBytes} }

type waiter struct {
	bytes       int64
	res         *reserve
	fromReserve bool // set before ready closes
	ready       chan struct{}
}

func newLimiter(slots int, bytes int64) *limiter {
	return &limiter{total: slots, slots: slots, bytes: bytes}
}

// held is how many slots of the shared pool are taken: for a connection's limiter, which
// has no reserves, how many of its requests are in flight.
func (l *limiter) held() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total - l.slots
}

// acquire takes one slot and n bytes, from res when it fits there (res may be nil), else
// from the shared pool, waiting unless done closes first. It reports whether it got them
// and whether they came from res; release must be told the same. n must not exceed the
// limiter's total, or it waits forever (the server sizes every limiter to hold at least
// one MaxRequest).
func (l *limiter) acquire(n int64, res *reserve, done <-chan struct{}) (ok, fromReserve bool) {
	l.mu.Lock()
	if res != nil && res.slots > 0 && res.bytes >= n {
		res.slots--
		res.bytes -= n
		l.mu.Unlock()
		return true, true
	}
	if len(l.queue) == 0 && l.slots > 0 && l.bytes >= n {
		l.slots--
		l.bytes -= n
		l.mu.Unlock()
		return true, false
	}
	w := &waiter{bytes: n, res: res, ready: make(chan struct{})}
	l.queue = append(l.queue, w)
	l.mu.Unlock()
	select {
	case <-w.ready:
		return true, w.fromReserve
	case <-done:
		l.mu.Lock()
		defer l.mu.Unlock()
		select {
		case <-w.ready:
			// Granted while we were giving up: hand it back.
			l.releaseLocked(n, res, w.fromReserve)
		default:
			for i, q := range l.queue {
				if q == w {
					l.queue = append(l.queue[:i], l.queue[i+1:]...)
					break
				}
			}
			// Those behind us may fit now.
			l.grantLocked()
		}
		return false, false
	}
}

// tryAcquire takes one slot and n bytes from the shared pool if they are free now and no
// one waits for them, and reports whether it did.
func (l *limiter) tryAcquire(n int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.queue) == 0 && l.slots > 0 && l.bytes >= n {
		l.slots--
		l.bytes -= n
		return true
	}
	return false
}

func (l *limiter) release(n int64, res *reserve, fromReserve bool) {
	l.mu.Lock()
	l.releaseLocked(n, res, fromReserve)
	l.mu.Unlock()
}

func (l *limiter) releaseLocked(n int64, res *reserve, fromReserve bool) {
	if fromReserve {
		res.slots++
		res.bytes += n
	} else {
		l.slots++
		l.bytes += n
	}
	l.grantLocked()
}

// grantLocked wakes every waiter that fits in its own reserve, and waiters for the shared
// pool in FIFO order up to the first that does not fit.
func (l *limiter) grantLocked() {
	if len(l.queue) == 0 {
		return
	}
	sharedBlocked := false
	kept := l.queue[:0]
	for _, w := range l.queue {
		switch {
		case w.res != nil && w.res.slots > 0 && w.res.bytes >= w.bytes:
			w.res.slots--
			w.res.bytes -= w.bytes
			w.fromReserve = true
			close(w.ready)
		case !sharedBlocked && l.slots > 0 && l.bytes >= w.bytes:
			l.slots--
			l.bytes -= w.bytes
			close(w.ready)
		default:
			sharedBlocked = true
			kept = append(kept, w)
		}
	}
	clear(l.queue[len(kept):])
	l.queue = kept
}

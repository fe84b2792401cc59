package nbd

import "sync"

// limiter bounds what requests in flight may hold: a number of requests and a number of
// payload bytes. A request takes one slot and its payload size at once, in FIFO order, so a
// 32 MiB write is not starved by a stream of small ones. The reader goroutine of a
// connection blocks in acquire, and stops reading the socket: backpressure reaches the
// client through the transport instead of through memory.
type limiter struct {
	mu    sync.Mutex
	slots int
	bytes int64
	queue []*waiter
}

type waiter struct {
	bytes int64
	ready chan struct{}
}

func newLimiter(slots int, bytes int64) *limiter {
	return &limiter{slots: slots, bytes: bytes}
}

// acquire takes one slot and n bytes, waiting for them unless done closes first; it
// reports whether it got them. n must not exceed the limiter's total, or it waits forever
// (the server sizes every limiter to hold at least one MaxRequest).
func (l *limiter) acquire(n int64, done <-chan struct{}) bool {
	l.mu.Lock()
	if len(l.queue) == 0 && l.slots > 0 && l.bytes >= n {
		l.slots--
		l.bytes -= n
		l.mu.Unlock()
		return true
	}
	w := &waiter{bytes: n, ready: make(chan struct{})}
	l.queue = append(l.queue, w)
	l.mu.Unlock()
	select {
	case <-w.ready:
		return true
	case <-done:
		l.mu.Lock()
		defer l.mu.Unlock()
		select {
		case <-w.ready:
			// Granted while we were giving up: hand it back.
			l.releaseLocked(n)
		default:
			for i, q := range l.queue {
				if q == w {
					l.queue = append(l.queue[:i], l.queue[i+1:]...)
					break
				}
			}
			// The head may have been waiting behind us.
			l.grantLocked()
		}
		return false
	}
}

func (l *limiter) release(n int64) {
	l.mu.Lock()
	l.releaseLocked(n)
	l.mu.Unlock()
}

func (l *limiter) releaseLocked(n int64) {
	l.slots++
	l.bytes += n
	l.grantLocked()
}

func (l *limiter) grantLocked() {
	for len(l.queue) > 0 {
		w := l.queue[0]
		if l.slots == 0 || l.bytes < w.bytes {
			return
		}
		l.slots--
		l.bytes -= w.bytes
		l.queue[0] = nil
		l.queue = l.queue[1:]
		close(w.ready)
	}
}

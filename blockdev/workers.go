package blockdev

import (
	"sync"
	"sync/atomic"
)

// workers is a fixed pool of goroutines that seal and open the chunks of large requests.
// The requesting goroutine works too, taking chunks from the same counter, so a request
// never waits for a busy pool: when every worker is taken by other requests, the caller
// simply does all its chunks itself. Small requests never touch the pool.
type workers struct {
	jobs chan *task
	wg   sync.WaitGroup
	n    int
}

type task struct {
	fn     func(lo, hi int) error
	n      int
	chunk  int
	next   atomic.Int64
	done   sync.WaitGroup
	errMu  sync.Mutex
	err    error
	errIdx int
}

func newWorkers(n int) *workers {
	w := &workers{jobs: make(chan *task, n), n: n}
	for range n {
		w.wg.Go(func() {
			for t := range w.jobs {
				t.work()
			}
		})
	}
	return w
}

func (w *workers) stop() {
	close(w.jobs)
	w.wg.Wait()
}

// run calls fn on [0, n) split into chunks of at most chunk items, in parallel, and
// returns the error of the lowest chunk that failed.
func (w *workers) run(n, chunk int, fn func(lo, hi int) error) error {
	chunks := (n + chunk - 1) / chunk
	if chunks <= 1 || w.n == 0 {
		return fn(0, n)
	}
	// A task is not reused: a worker may pick it up after the caller has returned and
	// still touch its counter.
	t := &task{fn: fn, n: n, chunk: chunk}
	t.done.Add(chunks)
	for range min(w.n, chunks-1) {
		select {
		case w.jobs <- t:
		default:
		}
	}
	t.work()
	t.done.Wait()
	return t.err
}

func (t *task) work() {
	for {
		c := int(t.next.Add(1) - 1)
		lo := c * t.chunk
		if lo >= t.n {
			return
		}
		if err := t.fn(lo, min(lo+t.chunk, t.n)); err != nil {
			t.errMu.Lock()
			if t.err == nil || c < t.errIdx {
				t.err, t.errIdx = err, c
			}
			t.errMu.Unlock()
		}
		t.done.Done()
	}
}

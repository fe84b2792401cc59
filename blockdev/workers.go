package blockdev

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// workers is a fixed pool of goroutines (GOMAXPROCS unless Config.Workers says otherwise)
// that seal and open the chunks (64 KiB) of large requests, and write a commit's pieces
// where the provider takes parallel writes.
// The requesting goroutine works too, taking chunks from the same counter, so a request
// never waits for a busy pool: when every worker is taken by other requests, the caller
// simply does all its chunks itself. Small requests never touch the pool.
type workers struct {
	jobs chan *task
	wg   sync.WaitGroup
	n    int
}

type task struct {
	spin   bool // the workers poll for the next task a while before they park
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
			t, ok := <-w.jobs
			for ok {
				t.work()
				if t.spin {
					t, ok = w.poll()
				} else {
					t, ok = <-w.jobs
				}
			}
		})
	}
	return w
}

func (w *workers) stop() {
	close(w.jobs)
	w.wg.Wait()
}

// spinFor is how long a worker that finished a read keeps looking for the next task
// before it parks. A reader that issues one request at a time sends the next within
// microseconds, while a parked thread takes longer than that to wake on a VM, and the
// request waits for it with one core idle. Writes do not spin: there the pool's cores
// are better left to the caller and the committer: spinning after writes as well makes
// writes one at a time slower (BenchmarkDeviceVsRaw, qd=1; docs/benchmarks.md,
// "Measurements behind design choices").
const spinFor = 30 * time.Microsecond

// poll waits for the next task, spinning (and yielding to other goroutines) for spinFor
// before it blocks.
func (w *workers) poll() (*task, bool) {
	deadline := time.Now().Add(spinFor)
	for time.Now().Before(deadline) {
		select {
		case t, ok := <-w.jobs:
			return t, ok
		default:
			runtime.Gosched()
		}
	}
	t, ok := <-w.jobs
	return t, ok
}

// run calls fn on [0, n) split into chunks of at most chunk items, in parallel, and
// returns the error of the lowest chunk that failed.
func (w *workers) run(n, chunk int, fn func(lo, hi int) error) error {
	return w.start(n, chunk, fn, false)
}

// runRead is run for reads: the workers spin for the next task afterwards (spinFor).
func (w *workers) runRead(n, chunk int, fn func(lo, hi int) error) error {
	return w.start(n, chunk, fn, true)
}

func (w *workers) start(n, chunk int, fn func(lo, hi int) error, spin bool) error {
	chunks := (n + chunk - 1) / chunk
	if chunks <= 1 || w.n == 0 {
		return fn(0, n)
	}
	// A task is not reused: a worker may pick it up after the caller has returned and
	// still touch its counter.
	t := &task{fn: fn, n: n, chunk: chunk, spin: spin}
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

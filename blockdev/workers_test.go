package blockdev

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestWorkersRunAndSpin: run and runRead both call fn on every chunk exactly once with
// the work spread over the pool, and a pool whose workers are spinning after a read
// stops promptly.
func TestWorkersRunAndSpin(t *testing.T) {
	w := newWorkers(2)
	for _, read := range []bool{false, true, true, false} {
		var seen [1000]atomic.Int32
		fn := func(lo, hi int) error {
			for i := lo; i < hi; i++ {
				seen[i].Add(1)
			}
			time.Sleep(50 * time.Microsecond) // long enough for the workers to take chunks
			return nil
		}
		var err error
		if read {
			err = w.runRead(len(seen), 16, fn)
		} else {
			err = w.run(len(seen), 16, fn)
		}
		if err != nil {
			t.Fatal(err)
		}
		for i := range seen {
			if n := seen[i].Load(); n != 1 {
				t.Fatalf("read=%v: item %d handled %d times", read, i, n)
			}
		}
	}
	w.runRead(64, 16, func(lo, hi int) error { return nil }) // workers now spinning
	stopped := make(chan struct{})
	go func() { w.stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("the pool did not stop while its workers spun")
	}
}

package nbd

import (
	"testing"
	"time"
)

func TestLimiter(t *testing.T) {
	t.Parallel()
	l := newLimiter(2, 100)
	never := make(chan struct{})
	if !l.acquire(60, never) || !l.acquire(40, never) {
		t.Fatal("acquire within limits failed")
	}
	// Both slots and all bytes are taken: a big waiter queues first, a small one behind
	// it must not overtake it (FIFO, so large requests are not starved).
	order := make(chan int64, 2)
	go func() { l.acquire(90, never); order <- 90 }()
	time.Sleep(20 * time.Millisecond)
	go func() { l.acquire(15, never); order <- 15 }()
	time.Sleep(20 * time.Millisecond)
	l.release(40) // 40 bytes and a slot free: not enough for 90, and 15 must wait behind it
	select {
	case v := <-order:
		t.Fatalf("waiter %d got in ahead of the queue head", v)
	case <-time.After(50 * time.Millisecond):
	}
	l.release(60) // 100 free: 90 goes, leaving 10, too few for 15
	if v := <-order; v != 90 {
		t.Fatalf("first granted %d, want 90", v)
	}
	select {
	case <-order:
		t.Fatal("15 granted with 10 bytes free")
	case <-time.After(20 * time.Millisecond):
	}
	l.release(90)
	if v := <-order; v != 15 {
		t.Fatalf("second granted %d, want 15", v)
	}

	// A waiter that gives up leaves the queue and the budget intact.
	done := make(chan struct{})
	got := make(chan bool)
	go func() { got <- l.acquire(100, done) }()
	time.Sleep(20 * time.Millisecond)
	close(done)
	if <-got {
		t.Fatal("acquire succeeded with no budget")
	}
	l.release(15)
	if !l.acquire(100, never) {
		t.Fatal("budget lost")
	}
	if l.slots != 1 || l.bytes != 0 || len(l.queue) != 0 {
		t.Fatalf("limiter state slots=%d bytes=%d queue=%d", l.slots, l.bytes, len(l.queue))
	}
}

func TestBufPool(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 4096, 4097, 65536, 1 << 20, 3 << 20, MaxRequest} {
		b := getBuf(n)
		if len(*b) != n || cap(*b) < n || cap(*b)&(cap(*b)-1) != 0 {
			t.Fatalf("getBuf(%d): len %d cap %d", n, len(*b), cap(*b))
		}
		putBuf(b)
	}
}

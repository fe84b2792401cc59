package nbd

import (
	"testing"
	"time"
)

func TestLimiter(t *testing.T) {
	t.Parallel()
	l := newLimiter(2, 100)
	never := make(chan struct{})
	acq := func(n int64, done <-chan struct{}) bool { ok, _ := l.acquire(n, nil, done); return ok }
	if !acq(60, never) || !acq(40, never) {
		t.Fatal("acquire within limits failed")
	}
	// Both slots and all bytes are taken: a big waiter queues first, a small one behind
	// it must not overtake it (FIFO, so large requests are not starved).
	order := make(chan int64, 2)
	go func() { acq(90, never); order <- 90 }()
	time.Sleep(20 * time.Millisecond)
	go func() { acq(15, never); order <- 15 }()
	time.Sleep(20 * time.Millisecond)
	l.release(40, nil, false) // 40 bytes and a slot free: not enough for 90, and 15 must wait behind it
	select {
	case v := <-order:
		t.Fatalf("waiter %d got in ahead of the queue head", v)
	case <-time.After(50 * time.Millisecond):
	}
	l.release(60, nil, false) // 100 free: 90 goes, leaving 10, too few for 15
	if v := <-order; v != 90 {
		t.Fatalf("first granted %d, want 90", v)
	}
	select {
	case <-order:
		t.Fatal("15 granted with 10 bytes free")
	case <-time.After(20 * time.Millisecond):
	}
	l.release(90, nil, false)
	if v := <-order; v != 15 {
		t.Fatalf("second granted %d, want 15", v)
	}

	// A waiter that gives up leaves the queue and the budget intact.
	done := make(chan struct{})
	got := make(chan bool)
	go func() { got <- acq(100, done) }()
	time.Sleep(20 * time.Millisecond)
	close(done)
	if <-got {
		t.Fatal("acquire succeeded with no budget")
	}
	l.release(15, nil, false)
	if !acq(100, never) {
		t.Fatal("budget lost")
	}
	if l.slots != 1 || l.bytes != 0 || len(l.queue) != 0 {
		t.Fatalf("limiter state slots=%d bytes=%d queue=%d", l.slots, l.bytes, len(l.queue))
	}
}

// TestLimiterReserve: a request that fits in its connection's reserve goes through while
// the shared pool is exhausted and others queue for it; one that does not fit waits for
// the shared pool like anyone else, and a waiter whose reserve frees up is woken from it.
func TestLimiterReserve(t *testing.T) {
	t.Parallel()
	l := newLimiter(4, 64<<20)
	never := make(chan struct{})
	hog, victim := newReserve(), newReserve()
	// The hog takes the whole shared pool (its reserve cannot hold 32 MiB).
	for range 2 {
		if ok, fromRes := l.acquire(32<<20, hog, never); !ok || fromRes {
			t.Fatalf("hog's 32 MiB: ok=%v fromReserve=%v", ok, fromRes)
		}
	}
	// A third big request of the hog queues.
	hogGot := make(chan bool, 1)
	go func() { ok, _ := l.acquire(32<<20, hog, never); hogGot <- ok }()
	time.Sleep(20 * time.Millisecond)
	// The victim's small requests go through its reserve, up to the reserve's size.
	var held []int64
	for i := range reserveSlots {
		n := int64(reserveBytes / reserveSlots)
		ok, fromRes := l.acquire(n, victim, never)
		if !ok || !fromRes {
			t.Fatalf("victim request %d: ok=%v fromReserve=%v", i, ok, fromRes)
		}
		held = append(held, n)
	}
	// The reserve is used up: the next one waits, and is woken when the reserve frees.
	vicGot := make(chan bool, 1)
	go func() { _, fromRes := l.acquire(4096, victim, never); vicGot <- fromRes }()
	select {
	case <-vicGot:
		t.Fatal("victim got budget beyond its reserve while the pool is full")
	case <-time.After(30 * time.Millisecond):
	}
	l.release(held[0], victim, true)
	select {
	case fromRes := <-vicGot:
		if !fromRes {
			t.Fatal("victim's waiter was not granted from its reserve")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("victim's waiter not woken when its reserve freed")
	}
	select {
	case <-hogGot:
		t.Fatal("the hog's third request got in with the pool full")
	default:
	}
	l.release(32<<20, hog, false)
	if !<-hogGot {
		t.Fatal("hog's queued request not granted")
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

package blockdev

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// plainReenc is a length-preserving mode's re-encryption: sectors below lo are under the
// current key, from hi under the previous one; [lo, hi) is the window that the sweep is
// rewriting (busy), or, on a read-only device, the window a crash left, whose sectors
// fresh says. Requests hold rw shared for their whole length, and one that touches a busy
// window waits for it; the sweep moves the window with rw held exclusively, so a request
// sees one window from start to end, and the key of each of its sectors holds still.
type plainReenc struct {
	rw     sync.RWMutex
	lo, hi uint64
	busy   chan struct{} // closed when the sweep is done with the window
	err    error         // the sweep failed on the window: requests that touch it fail
	fresh  []bool        // read-only device: window sector lo+k is under the current key
	epoch  uint64
	// dirty: a client write since the sweep last synced. A window's checksums must not
	// be durable before the ciphertext they describe: a crash would keep the slot and
	// lose the write, and the sector's older ciphertext, not matching, would pass for
	// one under the current key.
	dirty atomic.Bool
	seq   uint64 // of the newest hotzone slot
	slot  []byte // scratch for encoding slots
	buf   []byte // the window's sectors
	sums  []byte
}

// plainWindowBytes bounds a window: requests that touch it wait while it is rewritten
// (BenchmarkReencrypt measures the choice).
const plainWindowBytes = 4 << 20

// current reports whether sector i is under the current key; the caller holds rw.
func (r *plainReenc) current(i uint64) bool {
	switch {
	case i < r.lo:
		return true
	case i >= r.hi:
		return false
	}
	return r.fresh != nil && r.fresh[i-r.lo]
}

// enter holds rw shared once the window does not hold any of [first, first+n) busy. A
// request that touches a window the sweep failed on fails: which of its sectors the
// sweep rewrote is for the hotzone to say at the next attach.
func (r *plainReenc) enter(first, n uint64) error {
	for {
		r.rw.RLock()
		touches := first+n > r.lo && first < r.hi
		switch {
		case !touches || (r.busy == nil && r.err == nil):
			return nil
		case r.err != nil:
			err := r.err
			r.rw.RUnlock()
			return err
		}
		b := r.busy
		r.rw.RUnlock()
		<-b
	}
}

func (r *plainReenc) leave() { r.rw.RUnlock() }

// errWindow is what requests that touch a window the sweep failed to rewrite get.
var errWindow = errors.New("the re-encryption failed while rewriting these sectors; reattach to recover them")

func (e *plainEngine) sweepStatus() *sweepState { return &e.sweep }

// startReencrypt: online, the current keys become the previous ones with nothing moved;
// at Open, the hotzone says where the sweep stands, and a window a crash left is
// rewritten at once on a writable device (read-only, its sectors are told apart by their
// checksums for as long as it is open).
func (e *plainEngine) startReencrypt(ks keySet, r Reencrypt, online bool) error {
	if online {
		prev := e.keys.cur
		e.keys.cur, e.keys.prev = ks, &prev
		e.re = &plainReenc{epoch: r.Epoch}
		e.sweep.cursor.Store(0)
		e.sweep.moved.Store(0)
		e.sweep.unreadable.Store(0)
		e.sweep.done.Store(false)
		return nil
	}
	z, err := readHotzone(e.p, r.Epoch, e.l.Sectors)
	if err != nil {
		return err
	}
	re := &plainReenc{epoch: r.Epoch}
	var fresh []bool
	if z != nil {
		re.seq, re.lo, re.hi = z.seq, z.lo, z.hi
		if fresh, err = e.windowState(z); err != nil {
			return err
		}
	}
	if r.Cursor > re.hi {
		// A checkpoint is taken after a window was rewritten and synced: at most the
		// end of the newest slot's window.
		return fmt.Errorf("the header's re-encryption checkpoint (sector %d) is ahead of the hotzone (sector %d): the hotzone was changed on the provider", r.Cursor, re.hi)
	}
	e.keys.prev = &ks
	e.re = re
	if e.ro {
		re.fresh = fresh
	} else if re.hi > re.lo {
		// Rewrite the window before serving: then every sector's key follows its position.
		if err := e.sweepWindow(re.lo, re.hi, fresh); err != nil {
			e.keys.prev, e.re = nil, nil
			return fmt.Errorf("finish the re-encryption's last window: %w", err)
		}
	}
	e.sweep.cursor.Store(re.hi)
	return nil
}

// windowState reads the window of slot z and says which of its sectors are under the
// current key: those whose ciphertext does not match the old one's checksum.
func (e *plainEngine) windowState(z *hotzoneSlot) ([]bool, error) {
	n := int(z.hi - z.lo)
	fresh := make([]bool, n)
	buf := make([]byte, e.s)
	for k := range n {
		if _, err := e.p.ReadAt(buf, e.geo.dataPos(z.lo+uint64(k))); err != nil {
			return nil, fmt.Errorf("read sector %d of the hotzone's window: %w", z.lo+uint64(k), err)
		}
		fresh[k] = !z.matches(k, buf)
	}
	return fresh, nil
}

func (e *plainEngine) sweepStep(n uint64) error {
	st := &e.sweep
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := e.re.err; err != nil {
		return err // only the hotzone, read at the next attach, knows the window now
	}
	first := st.cursor.Load()
	end := min(e.l.Sectors, first+n)
	window := uint64(max(1, min(hotzoneCap, plainWindowBytes/e.s)))
	for first < end {
		k := min(end-first, window)
		if err := e.sweepWindow(first, first+k, nil); err != nil {
			return err
		}
		first += k
		st.cursor.Store(first)
	}
	return nil
}

// sweepWindow rewrites sectors [lo, hi) (lo is the re-encryption's) under the current
// key: it holds them busy, reads their ciphertext, makes a hotzone slot with the checksum
// of each one's old ciphertext (zero for those fresh says are under the current key
// already) durable, and only then rewrites them in place and syncs. Data is written once;
// the price is a checksum per sector and a small write and sync per window.
func (e *plainEngine) sweepWindow(lo, hi uint64, fresh []bool) error {
	r := e.re
	r.rw.Lock()
	r.hi, r.busy, r.fresh = hi, make(chan struct{}), nil
	r.rw.Unlock()
	n := int(hi - lo)
	err := e.rewriteWindow(lo, n, fresh)
	r.rw.Lock()
	if err == nil {
		r.lo = hi
	} else {
		r.err = fmt.Errorf("sectors %d-%d: %w (%v)", lo, hi-1, errWindow, err)
	}
	close(r.busy)
	r.busy = nil
	r.rw.Unlock()
	return err
}

func (e *plainEngine) rewriteWindow(lo uint64, n int, fresh []bool) error {
	r, s := e.re, e.s
	if cap(r.buf) < n*s {
		r.buf = make([]byte, n*s)
	}
	buf := r.buf[:n*s]
	// Requests that wrote the window are done (the window is busy): make them durable
	// before their ciphertext is checksummed.
	if r.dirty.Swap(false) {
		if err := e.sync(); err != nil {
			return err
		}
	}
	if _, err := e.p.ReadAt(buf, e.geo.dataPos(lo)); err != nil {
		return fmt.Errorf("read sectors %d-%d: %w", lo, lo+uint64(n-1), err)
	}
	if cap(r.sums) < n*hotzoneSumLen {
		r.sums = make([]byte, n*hotzoneSumLen)
	}
	sums := r.sums[:n*hotzoneSumLen]
	moved := 0
	e.workers.run(n, e.chunkSectors, func(a, b int) error {
		for k := a; k < b; k++ {
			if fresh != nil && fresh[k] {
				clear(sums[k*hotzoneSumLen : (k+1)*hotzoneSumLen])
				continue
			}
			sum := sectorSum(buf[k*s : (k+1)*s])
			copy(sums[k*hotzoneSumLen:], sum[:])
		}
		return nil
	})
	r.seq++
	slot, off := encodeHotzone(&hotzoneSlot{seq: r.seq, epoch: r.epoch, lo: lo, hi: lo + uint64(n), sums: sums}, r.slot)
	r.slot = slot
	if err := e.writeTearable(slot, off); err != nil {
		return fmt.Errorf("write hotzone: %w", err)
	}
	if err := e.sync(); err != nil {
		return err
	}
	// The old ciphertext's checksums are durable: rewrite, run by run of moving sectors.
	for x := 0; x < n; {
		if fresh != nil && fresh[x] {
			x++
			continue
		}
		y := x + 1
		for y < n && (fresh == nil || !fresh[y]) {
			y++
		}
		part := buf[x*s : y*s]
		first := lo + uint64(x)
		err := e.workers.run(y-x, e.chunkSectors, func(a, b int) error {
			c := part[a*s : b*s]
			if err := e.keys.prev.plain.OpenRun(first+uint64(a), c, c); err != nil {
				return err
			}
			e.keys.cur.plain.SealRun(first+uint64(a), c, c)
			return nil
		})
		if err != nil {
			return fmt.Errorf("re-encrypt sectors %d-%d: %w", first, first+uint64(y-x-1), err)
		}
		if _, err := e.p.WriteAt(part, e.geo.dataPos(first)); err != nil {
			return fmt.Errorf("write sectors %d-%d: %w", first, first+uint64(y-x-1), err)
		}
		moved += y - x
		x = y
	}
	if err := e.sync(); err != nil {
		return err
	}
	e.sweep.moved.Add(uint64(moved))
	return nil
}

// finishSweep syncs: every window was synced when it was rewritten, and what clients
// wrote since is under the current key.
func (e *plainEngine) finishSweep() error { return e.sync() }

// forgetPrevious drops the previous keys and zeroes the hotzone, which a header without
// a re-encryption makes meaningless anyway.
func (e *plainEngine) forgetPrevious() error {
	e.keys.forgetPrevious()
	e.re = nil
	if _, err := e.p.WriteAt(make([]byte, 2*hotzoneSlotLen), hotzoneSlotOffset(0)); err != nil {
		return fmt.Errorf("zero the hotzone (harmless: it is ignored from now on): %w", err)
	}
	return e.sync()
}

package blockdev

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

// TestFlushCommitsItself: a Flush or FUA write that finds no commit running makes the
// commit (and in version 2 the slot that completes it) in its own goroutine, and the
// committer is not woken for the batches they commit. What they wrote reads back after
// a reopen.
func TestFlushCommitsItself(t *testing.T) {
	for _, version := range []uint32{0, layout.Version2} {
		t.Run(fmt.Sprintf("version=%d", version), func(t *testing.T) {
			v := newTestVolVersion(t, version, sector.ModeXChaCha20Poly1305, 4096, 256)
			v.cfg.CommitInterval = time.Hour // only flushes commit
			d := v.open(t)
			a := authOf(d)
			const n = 40
			buf := make([]byte, 4096)
			for k := range n {
				buf[0], buf[1] = byte(k), 0x5a
				var flags Flags
				if k%4 == 3 {
					flags = FUA
				}
				if err := d.WriteAt(buf, int64(k*3%256)*4096, flags); err != nil {
					t.Fatal(err)
				}
				if flags == 0 {
					if err := d.Flush(); err != nil {
						t.Fatal(err)
					}
				}
			}
			a.mu.Lock()
			jobs, wakes, committed := a.flushJobs, a.wakes, a.committed
			a.mu.Unlock()
			// Each flush commits its batch; in version 2 an empty slot completes it.
			want := uint64(n)
			if a.tree != nil { // version 2, or any with ELI_TEST_FORMAT2
				want = 2 * n
			}
			if jobs != want || committed != n {
				t.Errorf("%d flushes ran %d commit jobs and committed %d batches, want %d and %d", n, jobs, committed, want, n)
			}
			if wakes != 0 {
				t.Errorf("the committer woke %d times while flushes committed every batch", wakes)
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			d = v.open(t)
			defer d.Close()
			for k := range n {
				got := make([]byte, 4096)
				if err := d.ReadAt(got, int64(k*3%256)*4096); err != nil {
					t.Fatal(err)
				}
				buf[0] = byte(k)
				if !bytes.Equal(got, buf) {
					t.Fatalf("sector %d after reopen: % x…, want % x…", k*3%256, got[:2], buf[:2])
				}
			}
		})
	}
}

// TestCommitterWithoutFlush: writes that no flush asks for are committed by the committer
// after CommitInterval, also once it has gone to sleep with nothing pending, when the
// first write of a batch wakes it.
func TestCommitterWithoutFlush(t *testing.T) {
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 64)
	v.cfg.CommitInterval = time.Millisecond
	d := v.open(t)
	defer d.Close()
	a := authOf(d)
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second) // a hang guard only
		for {
			a.mu.Lock()
			ok := cond()
			a.mu.Unlock()
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("waited 20 s for %s", what)
			}
			time.Sleep(time.Millisecond)
		}
	}
	buf := make([]byte, 4096)
	for k := range 3 {
		waitFor("the committer to sleep untimed", func() bool { return a.asleep })
		if err := d.WriteAt(buf, int64(k)*4096, 0); err != nil {
			t.Fatal(err)
		}
		waitFor(fmt.Sprintf("batch %d to commit without a flush", k+1), func() bool { return a.committed == uint64(k+1) })
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.flushJobs != 0 {
		t.Errorf("%d commit jobs ran in flushes; there were none", a.flushJobs)
	}
}

package blockdev

import (
	"bytes"
	"errors"
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
			// Until the committer has first gone to wait, it may find a flush's job
			// under way and wait for that flush to poke it: a wake that the steady
			// state never has, and a busy machine can delay the goroutine that long.
			var wakes0 uint64
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
				a.batches.mu.Lock()
				waits := a.commits.waits
				wakes0 = a.commits.wakes
				a.batches.mu.Unlock()
				if waits > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the committer never went to wait")
				}
			}
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
			a.batches.mu.Lock()
			jobs, wakes, committed := a.commits.flushJobs, a.commits.wakes, a.batches.committed
			a.batches.mu.Unlock()
			// Each flush commits its batch; in version 2 an empty slot completes it.
			want := uint64(n)
			if a.l.Tree() { // version 2, or any with ELI_TEST_FORMAT2
				want = 2 * n
			}
			if jobs != want || committed != n {
				t.Errorf("%d flushes ran %d commit jobs and committed %d batches, want %d and %d", n, jobs, committed, want, n)
			}
			if wakes != wakes0 {
				t.Errorf("the committer woke %d times while flushes committed every batch", wakes-wakes0)
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
			a.batches.mu.Lock()
			ok := cond()
			a.batches.mu.Unlock()
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
		waitFor("the committer to sleep untimed", func() bool { return a.commits.wake.asleep })
		if err := d.WriteAt(buf, int64(k)*4096, 0); err != nil {
			t.Fatal(err)
		}
		waitFor(fmt.Sprintf("batch %d to commit without a flush", k+1), func() bool { return a.batches.committed == uint64(k+1) })
	}
	a.batches.mu.Lock()
	defer a.batches.mu.Unlock()
	if a.commits.flushJobs != 0 {
		t.Errorf("%d commit jobs ran in flushes; there were none", a.commits.flushJobs)
	}
}

// TestConcurrentFlushesWhenCommitFails: clients that write and flush at once, so that
// their flushes take turns at committing, while the provider starts failing: every
// client's flush or write then fails with the provider's error, none waits for ever,
// and Close reports the failure.
func TestConcurrentFlushesWhenCommitFails(t *testing.T) {
	for _, version := range []uint32{0, layout.Version2} {
		t.Run(fmt.Sprintf("version=%d", version), func(t *testing.T) {
			const n = 512
			l, size := layoutForVersion(t, version, sector.ModeXChaCha20Poly1305, 4096, n, layout.Align)
			mem := newMem(size)
			if err := Format(mem, l); err != nil {
				t.Fatal(err)
			}
			rec := newRecorder(mem.data)
			d, err := Open(rec, Config{Layout: l, Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 4096, testVolumeID),
				JournalKey: testJournalKey, Logger: discardLogger(), CommitInterval: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			rec.mu.Lock()
			rec.failAt = len(rec.events) + 200
			rec.mu.Unlock()
			const clients = 8
			errs := make(chan error, clients)
			for c := range clients {
				go func() {
					buf := make([]byte, 4096)
					for k := 0; ; k++ {
						buf[0] = byte(k)
						if err := d.WriteAt(buf, int64((c*61+k*7)%n)*4096, 0); err != nil {
							errs <- err
							return
						}
						if err := d.Flush(); err != nil {
							errs <- err
							return
						}
					}
				}()
			}
			for range clients {
				select {
				case err := <-errs:
					if !errors.Is(err, errCrashed) {
						t.Errorf("a client failed with %v, not the provider's error", err)
					}
				case <-time.After(30 * time.Second): // a hang guard only
					t.Fatal("a client still writes and flushes 30 s after the provider failed")
				}
			}
			if err := d.Close(); !errors.Is(err, errCrashed) {
				t.Errorf("Close after the failed commit: %v, want the provider's error", err)
			}
		})
	}
}

// TestFailedCommitKeepsReading: after a commit fails, the device reads on: every sector
// outside the failed batch as it was, also once the metadata blocks that the failed
// round patched in the cache have had to make room for others. In format version 2 the
// tree already held those blocks' new digests, so a block loaded again from the provider
// (which holds its older version) failed to verify, and reads of every sector it
// describes failed as if the volume had been tampered with.
func TestFailedCommitKeepsReading(t *testing.T) {
	t.Parallel()
	for _, version := range []uint32{0, layout.Version2} {
		t.Run(fmt.Sprintf("version=%d", version), func(t *testing.T) {
			t.Parallel()
			const s = 4096
			v := newTestVolVersion(t, version, sector.ModeXChaCha20Poly1305, s, 600)
			p := &tornJournal{memProvider: v.mem, lo: v.l.JournalOffset(), hi: v.l.JournalOffset() + v.l.JournalLen}
			v.cfg.CacheBytes = 2 * int64(v.l.MetaBlockSize()) // two blocks: reads of other groups evict
			v.cfg.Logger = discardLogger()
			d, err := Open(p, v.cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			model := make([]byte, d.Size())
			for i := range model {
				model[i] = byte(i*7 + 3)
			}
			if err := d.WriteAt(model, 0, FUA); err != nil {
				t.Fatal(err)
			}
			p.armed.Store(true)
			if err := d.WriteAt(make([]byte, s), s, FUA); !errors.Is(err, errTornJournal) {
				t.Fatalf("a FUA write whose commit fails: %v, want the provider's error", err)
			}
			evicted := d.Stats().CacheEvictions
			buf := make([]byte, s)
			for i := int64(v.l.RecordsPerGroup()); i < int64(v.l.Sectors); i += 17 {
				if err := d.ReadAt(buf, i*s); err != nil || !bytes.Equal(buf, model[i*s:(i+1)*s]) {
					t.Fatalf("sector %d after the failed commit: %v, equal %v", i, err, bytes.Equal(buf, model[i*s:(i+1)*s]))
				}
			}
			if d.Stats().CacheEvictions == evicted {
				t.Fatal("the reads of other groups evicted nothing: the test does not test")
			}
			for _, i := range []int64{0, 2, 3, int64(v.l.RecordsPerGroup()) - 1} {
				if err := d.ReadAt(buf, i*s); err != nil || !bytes.Equal(buf, model[i*s:(i+1)*s]) {
					t.Errorf("sector %d, beside the failed write: %v, equal %v", i, err, bytes.Equal(buf, model[i*s:(i+1)*s]))
				}
			}
		})
	}
}

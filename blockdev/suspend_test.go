package blockdev

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

// wipeSpy wraps a codec and records its Wipe, forwarding its runs of sectors.
type wipeSpy struct {
	sector.Codec
	wiped *atomic.Bool
}

func (w wipeSpy) Wipe() { w.wiped.Store(true); w.Codec.Wipe() }

type metaSpy struct {
	wipeSpy
	sector.MetaRunner
}

type plainSpy struct {
	wipeSpy
	sector.Runner
}

// spy returns c wrapped so that wiped says whether the device wiped it.
func spy(c sector.Codec) (sector.Codec, *atomic.Bool) {
	w := wipeSpy{Codec: c, wiped: new(atomic.Bool)}
	if m, ok := c.(sector.MetaRunner); ok && c.MetaSize() > 0 {
		return metaSpy{w, m}, w.wiped
	}
	return plainSpy{w, c.(sector.Runner)}, w.wiped
}

var suspendCases = []struct {
	name    string
	version uint32
	mode    sector.Mode
	s       int
}{
	{"xchacha-v1", 0, sector.ModeXChaCha20Poly1305, 512},
	{"xchacha-v2", layout.Version2, sector.ModeXChaCha20Poly1305, 4096},
	{"aes-xts", 0, sector.ModeAESXTS256, 4096},
	{"none", 0, sector.ModeNone, 512},
}

// waitHeld waits until n requests are held (a hang guard: held requests must not fail).
func waitHeld(t *testing.T, d *Device, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for d.Held() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests held, want %d", d.Held(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestSuspendResume: Suspend makes every write durable (a copy of the provider taken
// while suspended opens with an empty journal and every byte), wipes the codec, and holds
// reads, writes, zeroes, trims and flushes issued meanwhile: none returns until Resume,
// and then each succeeds, the writes in place.
func TestSuspendResume(t *testing.T) {
	t.Parallel()
	for _, tc := range suspendCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v := newTestVolVersion(t, tc.version, tc.mode, tc.s, 600)
			codec, wiped := spy(v.cfg.Codec)
			v.cfg.Codec = codec
			d := v.open(t)
			defer d.Close()
			s := int64(tc.s)
			model := make([]byte, d.Size())
			for i := range model {
				model[i] = byte(i * 7)
			}
			if err := d.WriteAt(model[:100*s], 0, 0); err != nil {
				t.Fatal(err)
			}
			// Acknowledged, not flushed: Suspend must commit it.
			if err := d.WriteAt(model[100*s:], 100*s, 0); err != nil {
				t.Fatal(err)
			}
			if err := d.Suspend(context.Background()); err != nil {
				t.Fatal(err)
			}
			if !wiped.Load() {
				t.Error("the codec was not wiped by Suspend")
			}
			if ok, since := d.Suspended(); !ok || since.IsZero() {
				t.Errorf("Suspended() = %v, %v", ok, since)
			}
			if err := d.Suspend(context.Background()); !errors.Is(err, ErrSuspended) {
				t.Errorf("a second Suspend: %v", err)
			}
			// What the provider holds now is the whole volume, with nothing to recover.
			snap := &memProvider{data: v.mem.snapshot()}
			cfg := v.cfg
			cfg.Codec = newCodec(t, tc.mode, tc.s, testVolumeID)
			cfg.ReadOnly = true
			d2, err := Open(snap, cfg)
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, d.Size())
			if err := d2.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
				t.Errorf("a copy of the suspended provider: %v, equal %v", err, bytes.Equal(got, model))
			}
			if r := d2.Recovery(); tc.mode.Authenticated() && r.Journal != "empty" {
				t.Errorf("the suspended provider's journal is %q, want empty", r.Journal)
			}
			d2.Close()

			// Requests issued while suspended.
			var wg sync.WaitGroup
			var done atomic.Int32
			errs := make(chan error, 8)
			run := func(name string, f func() error) {
				wg.Add(1)
				go func() {
					defer wg.Done()
					err := f()
					done.Add(1)
					if err != nil {
						errs <- fmt.Errorf("%s: %w", name, err)
					}
				}()
			}
			copy(model[300*s:310*s], bytes.Repeat([]byte{0xab}, int(10*s)))
			run("write", func() error { return d.WriteAt(model[300*s:310*s], 300*s, FUA) })
			readBack := make([]byte, 50*s)
			run("read", func() error { return d.ReadAt(readBack, 0) })
			run("flush", d.Flush)
			clear(model[20*s : 22*s])
			run("zeroes", func() error { return d.WriteZeroes(20*s, 2*s, 0) })
			run("trim", func() error { return d.Trim(400*s, 4*s, 0) })
			waitHeld(t, d, 5)
			time.Sleep(20 * time.Millisecond)
			if n := done.Load(); n != 0 {
				t.Fatalf("%d requests returned while the device was suspended", n)
			}
			if err := d.Resume(Keys{Codec: newCodec(t, tc.mode, tc.s, testVolumeID), JournalKey: testJournalKey}); err != nil {
				t.Fatal(err)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if ok, _ := d.Suspended(); ok {
				t.Error("still suspended after Resume")
			}
			// The read raced the zeroing (both were held; which came first is the
			// scheduler's): compare what nothing else touched.
			if !bytes.Equal(readBack[:20*s], model[:20*s]) || !bytes.Equal(readBack[22*s:], model[22*s:50*s]) {
				t.Error("a read held over the suspend returned other data")
			}
			if tc.mode.Authenticated() {
				clear(model[400*s : 404*s])
			} else if err := d.ReadAt(model[400*s:404*s], 400*s); err != nil {
				t.Fatal(err) // trimmed sectors of these modes read as anything
			}
			all := make([]byte, d.Size())
			if err := d.ReadAt(all, 0); err != nil || !bytes.Equal(all, model) {
				for i := int64(0); i < int64(len(all)); i += s {
					if !bytes.Equal(all[i:i+s], model[i:i+s]) {
						t.Logf("sector %d differs", i/s)
					}
				}
				t.Fatalf("after resume: %v, equal %v", err, bytes.Equal(all, model))
			}
		})
	}
}

// TestHoldReleasesInOrder: held requests are let in one at a time in the order they
// came, each once the one before it has entered; TestSuspendResume checks that what each
// does is right.
func TestHoldReleasesInOrder(t *testing.T) {
	t.Parallel()
	var h hold
	h.start()
	const n = 40
	var mu sync.Mutex
	var order []int
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := h.wait()
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			w.entered()
		}()
		for h.held() < i+1 { // i came before i+1
			time.Sleep(100 * time.Microsecond)
		}
	}
	h.release()
	wg.Wait()
	for i, got := range order {
		if got != i {
			t.Fatalf("entered in the order %v", order)
		}
	}
	if w := h.wait(); w != nil {
		t.Fatal("a request was held after the release")
	}
}

// TestSuspendManyHeld: many writes held by one suspend all land after the resume.
func TestSuspendManyHeld(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 200)
	d := v.open(t)
	defer d.Close()
	if err := d.Suspend(context.Background()); err != nil {
		t.Fatal(err)
	}
	const n = 100
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := d.WriteAt(bytes.Repeat([]byte{byte(i + 1)}, 512), int64(512*i), 0); err != nil {
				t.Error(err)
			}
		}()
	}
	waitHeld(t, d, n)
	if err := d.Resume(Keys{Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 512, testVolumeID), JournalKey: testJournalKey}); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	got := make([]byte, 512*n)
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if got[512*i] != byte(i+1) || got[512*i+511] != byte(i+1) {
			t.Fatalf("sector %d holds %d after the resume, want %d", i, got[512*i], i+1)
		}
	}
}

// TestResumeRefusesOtherKeys: Resume with a codec of another mode, or without the
// previous key that a re-encryption needs, fails and leaves the device suspended with its
// requests held; the right keys then resume it.
func TestResumeRefusesOtherKeys(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 200)
	d := v.open(t)
	defer d.Close()
	if err := d.Resume(Keys{}); !errors.Is(err, ErrNotSuspended) {
		t.Fatalf("Resume of a serving device: %v", err)
	}
	if err := d.Suspend(context.Background()); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- d.ReadAt(make([]byte, 512), 0) }()
	waitHeld(t, d, 1)
	xts := codecWithKey(t, sector.ModeAESXTS256, 512, testDataKey)
	for name, k := range map[string]Keys{
		"no codec":         {JournalKey: testJournalKey},
		"another mode":     {Codec: xts, JournalKey: testJournalKey},
		"no journal key":   {Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 512, testVolumeID)},
		"a previous key":   {Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 512, testVolumeID), JournalKey: testJournalKey, Reencrypt: &Reencrypt{Prev: newCodec(t, sector.ModeXChaCha20Poly1305, 512, testVolumeID), PrevJournalKey: testJournalKey}},
		"a shorter sector": {Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 4096, testVolumeID), JournalKey: testJournalKey},
	} {
		if err := d.Resume(k); err == nil {
			t.Fatalf("%s: resumed", name)
		}
		if ok, _ := d.Suspended(); !ok || d.Held() != 1 {
			t.Fatalf("%s: suspended %v, held %d after a refused resume", name, ok, d.Held())
		}
	}
	select {
	case err := <-done:
		t.Fatalf("a held read returned after refused resumes: %v", err)
	default:
	}
	if err := d.Resume(Keys{Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 512, testVolumeID), JournalKey: testJournalKey}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestCloseSuspended: Close of a suspended device fails the held requests with
// ErrClosed (they were never acknowledged), needs no key, and leaves the provider as
// Suspend did: every write before the suspend there, nothing to recover.
func TestCloseSuspended(t *testing.T) {
	t.Parallel()
	for _, tc := range suspendCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v := newTestVolVersion(t, tc.version, tc.mode, tc.s, 300)
			d := v.open(t)
			want := bytes.Repeat([]byte{0x5a}, 30*tc.s)
			if err := d.WriteAt(want, int64(tc.s), 0); err != nil {
				t.Fatal(err)
			}
			if err := d.Suspend(context.Background()); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- d.WriteAt(make([]byte, tc.s), 0, 0) }()
			waitHeld(t, d, 1)
			if err := d.Close(); err != nil {
				t.Fatalf("Close of a suspended device: %v", err)
			}
			if err := <-done; !errors.Is(err, ErrClosed) {
				t.Fatalf("a held write at Close: %v, want ErrClosed", err)
			}
			v.cfg.Codec = newCodec(t, tc.mode, tc.s, testVolumeID)
			d2 := v.open(t)
			defer d2.Close()
			got := make([]byte, len(want))
			if err := d2.ReadAt(got, int64(tc.s)); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("after Close while suspended: %v, equal %v", err, bytes.Equal(got, want))
			}
			if r := d2.Recovery(); tc.mode.Authenticated() && r.Journal != "empty" {
				t.Errorf("journal %q after Close while suspended, want empty", r.Journal)
			}
		})
	}
}

// blockingSync is a provider whose Sync waits until release is closed.
type blockingSync struct {
	*memProvider
	release chan struct{}
	entered chan struct{}
	once    sync.Once
}

func (b *blockingSync) Sync() error {
	b.once.Do(func() { close(b.entered) })
	<-b.release
	return nil
}

// TestSuspendGivesUp: a request in flight that does not finish before Suspend's context
// ends fails the suspend, and the device serves on with its keys, while that request is
// still stuck; what came meanwhile was held and then served.
func TestSuspendGivesUp(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeAESXTS256, 512, 100)
	bp := &blockingSync{memProvider: v.mem, release: make(chan struct{}), entered: make(chan struct{})}
	d, err := Open(bp, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(bp.release) }) }
	defer release() // before Close, which waits for the stuck flush
	flushed := make(chan error, 1)
	go func() { flushed <- d.Flush() }()
	<-bp.entered
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	suspended := make(chan error, 1)
	go func() { suspended <- d.Suspend(ctx) }()
	read := make(chan error, 1)
	waitFor := time.Now().Add(30 * time.Second)
	for !d.hold.on.Load() && time.Now().Before(waitFor) {
		time.Sleep(time.Millisecond)
	}
	go func() { read <- d.ReadAt(make([]byte, 512), 0) }()
	if err := <-suspended; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Suspend with a request stuck in flight: %v", err)
	}
	// The device serves on at once, beside the request still stuck: a suspend that gave
	// up leaves nothing waiting for the gate (before, its Lock still waited, and held
	// every new request back until the stuck one ended).
	select {
	case err := <-read:
		if err != nil {
			t.Fatalf("a read that came during the failed suspend: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a read that came during the failed suspend waits for the request still stuck")
	}
	if err := d.ReadAt(make([]byte, 512), 512); err != nil {
		t.Fatalf("a read after the failed suspend: %v", err)
	}
	release()
	if err := <-flushed; err != nil {
		t.Fatal(err)
	}
	if ok, _ := d.Suspended(); ok {
		t.Fatal("suspended after a suspend that failed")
	}
	if err := d.WriteAt(make([]byte, 512), 0, FUA); err != nil {
		t.Fatal(err)
	}
}

// TestSuspendDuringReencryption: a suspend pauses a Sweeper between steps, records its
// checkpoint, holds its device with both keys wiped, and a resume with both keys lets the sweep finish; every
// sector then reads as written.
func TestSuspendDuringReencryption(t *testing.T) {
	t.Parallel()
	for _, tc := range reencCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l, mem := tc.volume(t)
			oldCodec, oldWiped := spy(codecWithKey(t, tc.from, tc.s, testDataKey))
			d, err := Open(mem, Config{Layout: l, Codec: oldCodec, JournalKey: testJournalKey, Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			model := make([]byte, d.Size())
			for i := range model {
				model[i] = byte(i*13 + 1)
			}
			if err := d.WriteAt(model, 0, FUA); err != nil {
				t.Fatal(err)
			}
			newCodec, newWiped := spy(codecWithKey(t, tc.to, tc.s, testDataKey2))
			if err := d.StartReencrypt(newCodec, testJournalKey2, 1); err != nil {
				t.Fatal(err)
			}
			// The sweeper stops after its third step until the device is suspended.
			var steps atomic.Int64
			var recorded atomic.Uint64 // the header's checkpoint
			third, suspended := make(chan struct{}), make(chan struct{})
			sw := NewSweeper(d, SweeperConfig{StepBytes: int64(8 * tc.s), Yield: -1,
				Checkpoint: func(c uint64) error { recorded.Store(c); return nil },
				OnProgress: func(ReencryptStatus) {
					if steps.Add(1) == 3 {
						close(third)
						<-suspended
					}
				}})
			ran := make(chan error, 1)
			go func() { ran <- sw.Run(context.Background()) }()
			<-third
			if err := d.Suspend(context.Background()); err != nil {
				t.Fatal(err)
			}
			close(suspended)
			if !oldWiped.Load() || !newWiped.Load() {
				t.Errorf("wiped: previous key %v, current key %v; want both", oldWiped.Load(), newWiped.Load())
			}
			at := d.Reencryption()
			if !at.Active || at.Cursor == at.Sectors {
				t.Fatalf("suspended the sweep at %+v: it should be halfway", at)
			}
			if c := recorded.Load(); c != at.Cursor {
				t.Fatalf("the suspend recorded checkpoint %d; the sweep stands at %d", c, at.Cursor)
			}
			time.Sleep(30 * time.Millisecond)
			if st := d.Reencryption(); st.Cursor != at.Cursor {
				t.Fatalf("the sweep moved from %d to %d while suspended", at.Cursor, st.Cursor)
			}
			// The previous key is needed too.
			if err := d.Resume(Keys{Codec: codecWithKey(t, tc.to, tc.s, testDataKey2), JournalKey: testJournalKey2}); err == nil {
				t.Fatal("resumed without the previous key")
			}
			err = d.Resume(Keys{Codec: codecWithKey(t, tc.to, tc.s, testDataKey2), JournalKey: testJournalKey2,
				Reencrypt: &Reencrypt{Prev: codecWithKey(t, tc.from, tc.s, testDataKey), PrevJournalKey: testJournalKey}})
			if err != nil {
				t.Fatal(err)
			}
			if err := <-ran; err != nil {
				t.Fatal(err)
			}
			if st := d.Reencryption(); st.Active {
				t.Fatalf("the re-encryption did not finish: %+v", st)
			}
			got := make([]byte, d.Size())
			if err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
				t.Fatalf("after the re-encryption across a suspend: %v, equal %v", err, bytes.Equal(got, model))
			}
		})
	}
}

// TestSuspendWaitsForSweepEnd: a re-encryption's end (the header's Finish, the previous
// key dropped) needs the keys, so a suspend waits for it as for a step: one whose context
// ends first changes nothing; once the end is done, a suspend and a resume need only
// the new key.
func TestSuspendWaitsForSweepEnd(t *testing.T) {
	t.Parallel()
	tc := reencCases[0]
	l, mem := tc.volume(t)
	d, err := Open(mem, Config{Layout: l, Codec: codecWithKey(t, tc.from, tc.s, testDataKey), JournalKey: testJournalKey, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.WriteAt(make([]byte, 64*tc.s), 0, FUA); err != nil {
		t.Fatal(err)
	}
	if err := d.StartReencrypt(codecWithKey(t, tc.to, tc.s, testDataKey2), testJournalKey2, 1); err != nil {
		t.Fatal(err)
	}
	finishing, finish := make(chan struct{}), make(chan struct{})
	sw := NewSweeper(d, SweeperConfig{Yield: -1, Finish: func() error {
		close(finishing)
		<-finish
		return nil
	}})
	ran := make(chan error, 1)
	go func() { ran <- sw.Run(context.Background()) }()
	<-finishing
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	err = d.Suspend(ctx)
	cancel()
	if err == nil {
		t.Fatal("suspended while the re-encryption's end ran")
	}
	if ok, _ := d.Suspended(); ok {
		t.Fatal("a suspend that gave up left the device suspended")
	}
	close(finish)
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
	if err := d.Suspend(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := d.Resume(Keys{Codec: codecWithKey(t, tc.to, tc.s, testDataKey2), JournalKey: testJournalKey2}); err != nil {
		t.Fatal(err)
	}
	if err := d.ReadAt(make([]byte, 64*tc.s), 0); err != nil {
		t.Fatal(err)
	}
}

// tornJournal is a provider whose next write into the journal region, once armed, lands
// in part and fails; it counts the journal writes that reach it after that one.
type tornJournal struct {
	*memProvider
	lo, hi int64
	armed  atomic.Bool
	failed atomic.Bool
	after  atomic.Int64
}

var errTornJournal = errors.New("journal write failed part-way (test)")

func (p *tornJournal) WriteAt(b []byte, off int64) (int, error) {
	if off >= p.lo && off < p.hi {
		if p.armed.CompareAndSwap(true, false) {
			p.failed.Store(true)
			n, _ := p.memProvider.WriteAt(b[:len(b)/2], off)
			return n, errTornJournal
		}
		if p.failed.Load() {
			p.after.Add(1)
		}
	}
	return p.memProvider.WriteAt(b, off)
}

// TestFailedEmptySlotStopsWrites: the empty journal slot that a suspend leaves, and the
// one that ends a re-encryption's sweep, fail part-way: the device then stops its writes
// as after any failed commit, reads on, and writes nothing more into the journal. In
// format version 2 a device that wrote on would put its next slot over the other one,
// the only one that holds the current root, and a crash during that write would leave
// no slot that opens: the volume then no longer attaches, flushed writes and all.
func TestFailedEmptySlotStopsWrites(t *testing.T) {
	t.Parallel()
	for _, version := range []uint32{0, layout.Version2} {
		for _, step := range []string{"suspend", "sweep-end"} {
			t.Run(fmt.Sprintf("version=%d/%s", version, step), func(t *testing.T) {
				t.Parallel()
				const s = 4096
				v := newTestVolVersion(t, version, sector.ModeXChaCha20Poly1305, s, 300)
				p := &tornJournal{memProvider: v.mem, lo: v.l.JournalOffset(), hi: v.l.JournalOffset() + v.l.JournalLen}
				d, err := Open(p, v.cfg)
				if err != nil {
					t.Fatal(err)
				}
				want := bytes.Repeat([]byte{0xa5}, 8*s)
				if err := d.WriteAt(want, 0, FUA); err != nil {
					t.Fatal(err)
				}
				if step == "sweep-end" {
					if err := d.StartReencrypt(codecWithKey(t, sector.ModeXChaCha20Poly1305, s, testDataKey2), testJournalKey2, 1); err != nil {
						t.Fatal(err)
					}
					if _, err := d.Sweep(v.l.Sectors); err != nil {
						t.Fatal(err)
					}
					if err := d.Flush(); err != nil {
						t.Fatal(err)
					}
				}
				p.armed.Store(true)
				if step == "suspend" {
					err = d.Suspend(context.Background())
				} else {
					err = d.FinishSweep()
				}
				if !errors.Is(err, errTornJournal) {
					t.Fatalf("%s with a journal write that fails: %v, want the provider's error", step, err)
				}
				if ok, _ := d.Suspended(); ok {
					t.Fatal("suspended after a suspend that failed")
				}
				if err := d.WriteAt(make([]byte, s), 8*s, 0); !errors.Is(err, errTornJournal) {
					t.Errorf("a write after the failed journal write: %v, want the provider's error", err)
				}
				got := make([]byte, len(want))
				if err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
					t.Errorf("a read after the failed journal write: %v, equal %v", err, bytes.Equal(got, want))
				}
				d.Close()
				if n := p.after.Load(); n > 0 {
					t.Errorf("%d journal writes reached the provider after the one that failed", n)
				}
			})
		}
	}
}

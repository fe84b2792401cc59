package blockdev

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

var (
	testDataKey2    = seqBytes(0x61, 64)
	testJournalKey2 = bytes.Repeat([]byte{0x2b}, 32)
)

// codecWithKey is newCodec under another data key (the real codecs only).
func codecWithKey(t testing.TB, mode sector.Mode, sectorSize int, key []byte) sector.Codec {
	t.Helper()
	c, err := sector.New(sector.Params{Mode: mode, SectorSize: sectorSize, Key: key[:mode.KeySize()], VolumeID: testVolumeID})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

type reencCase struct {
	name     string
	version  uint32
	from, to sector.Mode
	s        int
	n        uint64
}

// volume formats a memory provider for the case's first mode.
func (tc reencCase) volume(t *testing.T) (Layout, *memProvider) {
	t.Helper()
	l, size := layoutForVersion(t, tc.version, tc.from, tc.s, tc.n, layout.Align)
	mem := newMem(size)
	if err := Format(mem, l); err != nil {
		t.Fatal(err)
	}
	return l, mem
}

var reencCases = []reencCase{
	{"xchacha-v1", 0, sector.ModeXChaCha20Poly1305, sector.ModeXChaCha20Poly1305, 512, 700},
	{"xchacha-v2", layout.Version2, sector.ModeXChaCha20Poly1305, sector.ModeXChaCha20Poly1305, 4096, 300},
	{"aes-xts", 0, sector.ModeAESXTS256, sector.ModeAESXTS256, 512, 5000},
	{"none-to-aes128-xts", 0, sector.ModeNone, sector.ModeAESXTS128, 4096, 900},
}

// TestReencryptOnline: a re-encryption started on a live device moves every sector to
// the new key while writes, trims and reads go on, and the volume then opens with the new
// keys alone, every sector as the model says.
func TestReencryptOnline(t *testing.T) {
	t.Parallel()
	for _, tc := range reencCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l, mem := tc.volume(t)
			old := codecWithKey(t, tc.from, tc.s, testDataKey)
			cfg := Config{Layout: l, Codec: old, JournalKey: testJournalKey, Logger: testLogger(t)}
			d, err := Open(mem, cfg)
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(uint64(tc.n), 7))
			model := make([]byte, d.Size())
			trims := true
			op := func() {
				off := rng.Int64N(d.Size())
				n := min(1+rng.Int64N(int64(9*tc.s)), d.Size()-off)
				switch rng.IntN(5) {
				case 0:
					if !trims {
						return
					}
					if err := d.Trim(off, n, 0); err != nil {
						t.Fatal(err)
					}
					if l.Authenticated() {
						s := int64(tc.s)
						if first, end := (off+s-1)/s, (off+n)/s; end > first {
							clear(model[first*s : end*s])
						}
					}
				case 1:
					got := make([]byte, n)
					if err := d.ReadAt(got, off); err != nil {
						t.Fatal(err)
					}
					if l.Authenticated() && !bytes.Equal(got, model[off:off+n]) {
						t.Fatalf("read %d@%d differs from the model", n, off)
					}
				default:
					p := make([]byte, n)
					randFill(rng, p)
					copy(model[off:], p)
					if err := d.WriteAt(p, off, 0); err != nil {
						t.Fatal(err)
					}
				}
			}
			for range 60 {
				op()
			}
			if !l.Authenticated() {
				// Trimmed sectors of length-preserving modes read as anything: the model
				// is what the device reads now.
				if err := d.ReadAt(model, 0); err != nil {
					t.Fatal(err)
				}
				trims = false
			}
			if err := d.Flush(); err != nil {
				t.Fatal(err)
			}
			neu := codecWithKey(t, tc.to, tc.s, testDataKey2)
			if err := d.StartReencrypt(neu, testJournalKey2, 1); err != nil {
				t.Fatal(err)
			}
			if err := d.StartReencrypt(neu, testJournalKey2, 1); !errors.Is(err, ErrReencrypting) {
				t.Fatalf("a second start: %v", err)
			}
			if err := d.FinishSweep(); !errors.Is(err, ErrSweepNotDone) {
				t.Fatalf("finish before the end: %v", err)
			}
			for {
				st, err := d.Sweep(uint64(1 + rng.IntN(200)))
				if err != nil {
					t.Fatal(err)
				}
				for range 3 {
					op()
				}
				if st.Cursor == st.Sectors {
					break
				}
			}
			if err := d.ForgetPrevious(); !errors.Is(err, ErrSweepNotDone) {
				t.Fatalf("forget before finishing: %v", err)
			}
			if err := d.FinishSweep(); err != nil {
				t.Fatal(err)
			}
			st := d.Reencryption()
			if !st.Done || st.Moved == 0 || st.Unreadable != 0 {
				t.Fatalf("status %+v", st)
			}
			if err := d.ForgetPrevious(); err != nil {
				t.Fatal(err)
			}
			if st := d.Reencryption(); st.Active {
				t.Fatalf("still active: %+v", st)
			}
			got := make([]byte, d.Size())
			if err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
				for i := 0; i < len(got); i += tc.s {
					if !bytes.Equal(got[i:i+tc.s], model[i:i+tc.s]) {
						t.Logf("sector %d differs", i/tc.s)
					}
				}
				t.Fatalf("read after the re-encryption: %v, equal %v", err, bytes.Equal(got, model))
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			// The new keys alone open every sector.
			cfg2 := Config{Layout: l, Codec: neu, JournalKey: testJournalKey2, Logger: testLogger(t)}
			cfg2.Layout.Mode = tc.to
			d2, err := Open(mem, cfg2)
			if err != nil {
				t.Fatal(err)
			}
			if err := d2.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
				t.Fatalf("read with the new key alone: %v, equal %v", err, bytes.Equal(got, model))
			}
			d2.Close()
			// The old keys open nothing that was written.
			if l.Authenticated() {
				d3, err := Open(mem, cfg)
				if l.Tree() {
					// Version 2: no journal slot opens under the old key, so nothing
					// authenticates the tree.
					if !errors.Is(err, ErrFreshness) {
						t.Fatalf("open with the old keys alone: %v", err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				if err := d3.ReadAt(got, 0); !errors.Is(err, sector.ErrAuth) {
					t.Fatalf("read with the old key alone: %v", err)
				}
				d3.Close()
			}
		})
	}
}

// TestReencryptConcurrentWriters: clients write whole sectors and read them back from
// several goroutines while a Sweeper moves the volume to the new key: a sweep step is a
// read-modify-write that must never put back a value older than a write it raced with.
func TestReencryptConcurrentWriters(t *testing.T) {
	t.Parallel()
	for _, tc := range []reencCase{
		{"xchacha", 0, sector.ModeXChaCha20Poly1305, sector.ModeXChaCha20Poly1305, 512, 3000},
		{"aes-xts", 0, sector.ModeAESXTS256, sector.ModeAESXTS256, 512, 3000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l, mem := tc.volume(t)
			cfg := Config{Layout: l, Codec: codecWithKey(t, tc.from, tc.s, testDataKey), JournalKey: testJournalKey,
				Logger: testLogger(t), CommitInterval: time.Millisecond}
			d, err := Open(mem, cfg)
			if err != nil {
				t.Fatal(err)
			}
			model := make([]byte, d.Size())
			randFill(rand.New(rand.NewPCG(1, 2)), model)
			if err := d.WriteAt(model, 0, FUA); err != nil {
				t.Fatal(err)
			}
			if err := d.StartReencrypt(codecWithKey(t, tc.to, tc.s, testDataKey2), testJournalKey2, 1); err != nil {
				t.Fatal(err)
			}
			sw := NewSweeper(d, SweeperConfig{StepBytes: int64(7 * tc.s), Yield: -1})
			done := make(chan error, 1)
			go func() { done <- sw.Run(context.Background()) }()
			const writers = 4
			var wg sync.WaitGroup
			var stop atomic.Bool
			for g := range writers {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 3))
					buf := make([]byte, tc.s)
					for k := 0; !stop.Load() || k < 200; k++ {
						// Mostly just ahead of the sweep, where its steps read what
						// these writes race with.
						i := int64(rng.IntN(int(tc.n)/writers)*writers + g)
						if c := int64(d.Reencryption().Cursor); rng.IntN(4) != 0 && c+64 < int64(tc.n) {
							i = (c+int64(rng.IntN(64)))/writers*writers + int64(g)
						}
						off := i * int64(tc.s)
						if rng.IntN(3) == 0 {
							if err := d.ReadAt(buf, off); err != nil {
								t.Error(err)
								return
							}
							if !bytes.Equal(buf, model[off:off+int64(tc.s)]) {
								t.Errorf("sector %d reads other than its last write", i)
								return
							}
							continue
						}
						randFill(rng, model[off:off+int64(tc.s)])
						if err := d.WriteAt(model[off:off+int64(tc.s)], off, 0); err != nil {
							t.Error(err)
							return
						}
					}
				})
			}
			if err := <-done; err != nil {
				t.Error(err)
			}
			stop.Store(true)
			wg.Wait()
			if t.Failed() {
				return
			}
			if st := d.Reencryption(); st.Active {
				t.Fatalf("the sweeper ended with %+v", st)
			}
			got := make([]byte, d.Size())
			if err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, model) {
				t.Fatalf("after the re-encryption: %v, equal %v", err, bytes.Equal(got, model))
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestSweeperPacing: MaxRate bounds the sweep (a lower bound on its time, which a slow
// machine only lengthens), SetMaxRate changes it while it runs, checkpoints only move
// forward and are not repeated, and a sweeper paused and checkpointed (suspend) records
// nothing more when its context ends.
func TestSweeperPacing(t *testing.T) {
	t.Parallel()
	tc := reencCase{"xchacha-v1", 0, sector.ModeXChaCha20Poly1305, sector.ModeXChaCha20Poly1305, 4096, 2048}
	l, mem := tc.volume(t)
	d, err := Open(mem, Config{Layout: l, Codec: codecWithKey(t, tc.from, tc.s, testDataKey), JournalKey: testJournalKey, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.WriteAt(bytes.Repeat([]byte{7}, int(d.Size())), 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.StartReencrypt(codecWithKey(t, tc.to, tc.s, testDataKey2), testJournalKey2, 1); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var cps []uint64
	const rate = 16 << 20
	cfg := SweeperConfig{StepBytes: 256 << 10, MaxRate: rate, CheckpointBytes: 1 << 20,
		Checkpoint: func(c uint64) error {
			mu.Lock()
			defer mu.Unlock()
			if len(cps) > 0 && c <= cps[len(cps)-1] {
				t.Errorf("checkpoint %d after %d", c, cps[len(cps)-1])
			}
			cps = append(cps, c)
			return nil
		}}
	ctx, cancel := context.WithCancel(context.Background())
	steps := 0
	var sw *Sweeper
	paused := make(chan uint64, 1)
	cfg.OnProgress = func(st ReencryptStatus) {
		if steps++; steps == 8 {
			sw.Pause() // returns at once: OnProgress comes after the step
			if err := sw.Checkpoint(); err != nil {
				t.Error(err)
			}
			paused <- st.Cursor
		}
	}
	sw = NewSweeper(d, cfg)
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- sw.Run(ctx) }()
	at := <-paused
	took := time.Since(start)
	if min := time.Duration(float64(at*uint64(tc.s)) / rate * float64(time.Second) * 0.8); took < min {
		t.Errorf("%d bytes swept in %v at a bound of %d bytes a second", at*uint64(tc.s), took, rate)
	}
	mu.Lock()
	n := len(cps)
	if n == 0 || cps[n-1] != at {
		t.Errorf("checkpoints %v, the paused sweep at %d", cps, at)
	}
	mu.Unlock()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run after its context ended: %v", err)
	}
	mu.Lock()
	if len(cps) != n {
		t.Errorf("a checkpoint at the end of a paused, checkpointed sweep: %v", cps)
	}
	mu.Unlock()
	// The rest without a bound, to the end.
	sw = NewSweeper(d, SweeperConfig{StepBytes: 256 << 10, MaxRate: 1})
	sw.SetMaxRate(0)
	if err := sw.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st := d.Reencryption(); st.Active {
		t.Fatalf("after the end: %+v", st)
	}
}

// TestSweeperRateRaised: a sweep resting under a very low MaxRate goes on as soon as
// SetMaxRate lifts the bound, rather than resting out what the old bound asked.
func TestSweeperRateRaised(t *testing.T) {
	t.Parallel()
	tc := reencCase{"xchacha-v1", 0, sector.ModeXChaCha20Poly1305, sector.ModeXChaCha20Poly1305, 4096, 512}
	l, mem := tc.volume(t)
	d, err := Open(mem, Config{Layout: l, Codec: codecWithKey(t, tc.from, tc.s, testDataKey), JournalKey: testJournalKey, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.StartReencrypt(codecWithKey(t, tc.to, tc.s, testDataKey2), testJournalKey2, 1); err != nil {
		t.Fatal(err)
	}
	stepped := make(chan struct{}, 1)
	cfg := SweeperConfig{StepBytes: 256 << 10, MaxRate: 1, // a day's rest after each step
		OnProgress: func(ReencryptStatus) {
			select {
			case stepped <- struct{}{}:
			default:
			}
		}}
	sw := NewSweeper(d, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- sw.Run(ctx) }()
	<-stepped
	sw.SetMaxRate(0)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the sweep still rests out its old bound after SetMaxRate(0)")
	}
	if st := d.Reencryption(); st.Active {
		t.Fatalf("re-encryption after the sweep: %+v", st)
	}
}

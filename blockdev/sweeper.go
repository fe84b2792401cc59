package blockdev

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// SweeperConfig says how a Sweeper paces a re-encryption and where it records it.
type SweeperConfig struct {
	// StepBytes is how much one step moves (DefaultSweepStepBytes when 0): the unit of
	// progress, of yielding and of pausing.
	StepBytes int64
	// Yield: after a step during which clients made requests, the sweep rests Yield
	// times the step's duration before the next (DefaultSweepYield when 0; negative:
	// never rests). With clients idle it runs flat out.
	Yield float64
	// CheckpointBytes and CheckpointInterval: how much sweeping, or how long, between
	// checkpoints (DefaultCheckpointBytes, DefaultCheckpointInterval when 0). What a
	// crash costs is redoing the sweep since the last one.
	CheckpointBytes    int64
	CheckpointInterval time.Duration
	// Checkpoint records that every sector below cursor is under the current key and
	// durable (keys.SetReencryptCursor). Run calls it after a Flush, at the intervals
	// above and when it stops early. Nil records nothing.
	Checkpoint func(cursor uint64) error
	// Finish drops the previous key from the volume's header (keys.FinishReencrypt):
	// Run calls it once the sweep's moves are durable, then Device.ForgetPrevious.
	Finish func() error
	// MaxRate, if positive, bounds the sweep to about that many bytes a second (rests
	// after each step), whatever the clients do.
	MaxRate int64
	// OnProgress is told the status after every step, from Run's goroutine.
	OnProgress func(ReencryptStatus)
}

// Defaults of SweeperConfig.
const (
	DefaultSweepStepBytes     = 4 << 20
	DefaultSweepYield         = 1.0
	DefaultCheckpointBytes    = 1 << 30
	DefaultCheckpointInterval = 10 * time.Second
)

// Sweeper drives a device's re-encryption from its cursor to the end: steps of Sweep,
// paced so that clients keep most of the device (it rests after a step that overlapped
// their requests), checkpoints recorded by the caller, and at the end the previous key
// dropped from the header and from the device. Pause holds it between steps, and so
// does Device.Suspend, on its own, after it has recorded a checkpoint; Run returns when
// the context ends, after a last checkpoint if the sweep moved since.
type Sweeper struct {
	d   *Device
	cfg SweeperConfig

	mu      sync.Mutex
	cond    sync.Cond
	paused  bool
	held    bool   // the device is suspended (Device.Suspend), apart from paused
	running bool   // a step (and the checkpoint after it) is under way
	cp      uint64 // the last checkpoint recorded (or the device's cursor when Run began)

	cpMu sync.Mutex // one checkpoint at a time: Run's, or Checkpoint's

	maxRate     atomic.Int64  // SweeperConfig.MaxRate, which SetMaxRate changes
	rateChanged chan struct{} // kicked by SetMaxRate: a rest under way is measured again
}

// NewSweeper makes a sweeper for d, which must hold a re-encryption (Config.Reencrypt at
// Open, or StartReencrypt).
func NewSweeper(d *Device, cfg SweeperConfig) *Sweeper {
	if cfg.StepBytes <= 0 {
		cfg.StepBytes = DefaultSweepStepBytes
	}
	if cfg.Yield == 0 {
		cfg.Yield = DefaultSweepYield
	}
	if cfg.CheckpointBytes <= 0 {
		cfg.CheckpointBytes = DefaultCheckpointBytes
	}
	if cfg.CheckpointInterval <= 0 {
		cfg.CheckpointInterval = DefaultCheckpointInterval
	}
	s := &Sweeper{d: d, cfg: cfg, rateChanged: make(chan struct{}, 1)}
	s.cond.L = &s.mu
	s.maxRate.Store(max(cfg.MaxRate, 0))
	// Device.Suspend holds it; one made while the device is suspended starts held.
	d.susMu.Lock()
	d.sweeper.Store(s)
	s.held, _ = d.Suspended()
	d.susMu.Unlock()
	return s
}

// SetMaxRate changes SweeperConfig.MaxRate (0: no bound), for the rest under way too: a
// rest that a low bound made long ends as soon as the new bound allows.
func (s *Sweeper) SetMaxRate(bytesPerSecond int64) {
	s.maxRate.Store(max(bytesPerSecond, 0))
	select {
	case s.rateChanged <- struct{}{}:
	default:
	}
}

// Pause keeps the sweeper from starting another step, and returns once no step runs: the
// device then has no sweep I/O under way until Resume.
func (s *Sweeper) Pause() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.paused = true
	for s.running {
		s.cond.Wait()
	}
}

// Resume lets a paused sweeper go on.
func (s *Sweeper) Resume() {
	s.mu.Lock()
	s.paused = false
	s.cond.Broadcast()
	s.mu.Unlock()
}

// hold is Pause for Device.Suspend, which a Resume of the sweeper's own does not undo:
// it returns once no step runs, or with ctx's error if one still does when ctx ends
// (the sweeper is then not held).
func (s *Sweeper) hold(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() {
		s.mu.Lock()
		s.cond.Broadcast()
		s.mu.Unlock()
	})
	defer stop()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.held = true
	for s.running {
		if err := ctx.Err(); err != nil {
			s.held = false
			s.cond.Broadcast()
			return err
		}
		s.cond.Wait()
	}
	return nil
}

// unhold ends hold.
func (s *Sweeper) unhold() {
	s.mu.Lock()
	s.held = false
	s.cond.Broadcast()
	s.mu.Unlock()
}

// begin waits while paused or held, then marks a step as running; false if ctx ended.
func (s *Sweeper) begin(ctx context.Context) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for (s.paused || s.held) && ctx.Err() == nil {
		s.cond.Wait()
	}
	if ctx.Err() != nil {
		return false
	}
	s.running = true
	return true
}

func (s *Sweeper) end() {
	s.mu.Lock()
	s.running = false
	s.cond.Broadcast()
	s.mu.Unlock()
}

// Run sweeps until every sector is under the current key, then finishes the
// re-encryption (FinishSweep, Config.Finish, ForgetPrevious), and returns nil. If ctx
// ends first it records a last checkpoint and returns ctx's error; on a failure it
// returns that, and the re-encryption resumes from the last checkpoint at the next run.
func (s *Sweeper) Run(ctx context.Context) error {
	d := s.d
	if !d.Reencryption().Active {
		return ErrNotReencrypting
	}
	// A pause must wake a waiting Run when ctx ends.
	stop := context.AfterFunc(ctx, func() {
		s.mu.Lock()
		s.cond.Broadcast()
		s.mu.Unlock()
	})
	defer stop()
	step := uint64(max(1, s.cfg.StepBytes/int64(d.s)))
	cpSectors := uint64(max(1, s.cfg.CheckpointBytes/int64(d.s)))
	st := d.Reencryption()
	s.mu.Lock()
	s.cp = st.Cursor // what the header says, or less
	s.mu.Unlock()
	cpTime := time.Now()
	for st.Cursor < st.Sectors {
		if !s.begin(ctx) {
			return errors.Join(ctx.Err(), s.checkpoint(st.Cursor))
		}
		before := d.activity.Load()
		start := time.Now()
		var err error
		st, err = d.Sweep(step)
		took := time.Since(start)
		busy := d.activity.Load() != before
		if err == nil && st.Cursor < st.Sectors && (st.Cursor-s.checkpointed() >= cpSectors || time.Since(cpTime) >= s.cfg.CheckpointInterval) {
			if err = s.checkpoint(st.Cursor); err == nil {
				cpTime = time.Now()
			}
		}
		s.end()
		if err != nil {
			return fmt.Errorf("re-encryption at sector %d: %w", st.Cursor, err)
		}
		if s.cfg.OnProgress != nil {
			s.cfg.OnProgress(st)
		}
		if st.Cursor == st.Sectors {
			break
		}
		s.rest(ctx, int64(step)*int64(d.s), took, busy)
	}
	// The end is a step too: a suspend waits for it or holds it, since it needs the keys.
	if !s.begin(ctx) {
		return errors.Join(ctx.Err(), s.checkpoint(st.Cursor))
	}
	err := s.finish()
	s.end()
	if err != nil {
		return err
	}
	if s.cfg.OnProgress != nil {
		s.cfg.OnProgress(d.Reencryption())
	}
	return nil
}

// rest waits after a step of n bytes that took took (busy: client requests overlapped
// it): a Yield of that time when busy, and as long as MaxRate asks, measured again when
// SetMaxRate changes it; until ctx ends at the latest.
func (s *Sweeper) rest(ctx context.Context, n int64, took time.Duration, busy bool) {
	var yield time.Duration
	if s.cfg.Yield > 0 && busy {
		yield = time.Duration(s.cfg.Yield * float64(took))
	}
	start := time.Now()
	for {
		rest := yield
		if r := s.maxRate.Load(); r > 0 {
			rest = max(rest, time.Duration(float64(n)/float64(r)*float64(time.Second))-took)
		}
		rest -= time.Since(start)
		if rest <= 0 {
			return
		}
		t := time.NewTimer(rest)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
			return
		case <-s.rateChanged:
			t.Stop()
		}
	}
}

// finish ends the re-encryption once the sweep has reached the end.
func (s *Sweeper) finish() error {
	d := s.d
	if err := d.FinishSweep(); err != nil {
		return fmt.Errorf("finish the re-encryption's sweep: %w", err)
	}
	if s.cfg.Finish != nil {
		if err := s.cfg.Finish(); err != nil {
			return fmt.Errorf("drop the previous key from the header: %w", err)
		}
	}
	if err := d.ForgetPrevious(); err != nil {
		return fmt.Errorf("drop the previous key from the device: %w", err)
	}
	return nil
}

// Checkpoint records where the sweep stands now (a flush, then Config.Checkpoint), for
// a paused or held sweeper whose device is about to stop serving for a while
// (Device.Suspend calls it): the checkpoint that Run records when its context ends is
// then skipped if the sweep has not moved since. Call it while no step runs.
func (s *Sweeper) Checkpoint() error {
	st := s.d.Reencryption()
	if !st.Active || st.Done {
		return nil
	}
	return s.checkpoint(st.Cursor)
}

func (s *Sweeper) checkpointed() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cp
}

// checkpoint makes what the sweep moved below cursor durable and records it, unless
// that is recorded already.
func (s *Sweeper) checkpoint(cursor uint64) error {
	s.cpMu.Lock()
	defer s.cpMu.Unlock()
	if s.cfg.Checkpoint == nil || cursor <= s.checkpointed() {
		return nil
	}
	if err := s.d.Flush(); err != nil {
		return fmt.Errorf("re-encryption checkpoint at sector %d: %w", cursor, err)
	}
	if err := s.cfg.Checkpoint(cursor); err != nil {
		return fmt.Errorf("re-encryption checkpoint at sector %d: %w", cursor, err)
	}
	s.mu.Lock()
	s.cp = max(s.cp, cursor)
	s.mu.Unlock()
	return nil
}

package volume

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/reencrypt"
)

// An attached volume's re-encryption (docs/design.md, "Re-encryption"): the server
// holds the provider, so it writes the header's start, checkpoints and end and runs the
// sweep (package reencrypt's Online), in a goroutine of its own while it serves. One
// under way when the volume opened read-write resumes as soon as the server serves;
// Close stops the sweep at a step's end and records where it stands, for the next
// attach to go on from.

// Re-encryption states in ReencryptStatus.
const (
	ReencryptRunning = "running" // the sweep runs (resting while clients are busy)
	ReencryptPaused  = "paused"  // held between steps while the volume is suspended
	ReencryptWaiting = "waiting" // under way, not swept by this server: attached read-only
	ReencryptStopped = "stopped" // the sweep failed (Error says why); 'eli reencrypt' resumes it
	ReencryptDone    = "done"    // ended in this server: the old key is gone from the header
)

// ReencryptStatus is a volume's re-encryption in its Status: one under way, or one that
// ended while this server ran.
type ReencryptStatus struct {
	State string `json:"state"`
	// Epoch is the re-encryption's key epoch (the header's), From and To its modes.
	Epoch uint64 `json:"epoch"`
	From  string `json:"from"`
	To    string `json:"to"`
	// Cursor: every sector below it is under the new key; Sectors is the volume's.
	Cursor     uint64 `json:"cursor"`
	Sectors    uint64 `json:"sectors"`
	SectorSize int    `json:"sector_size"`
	// Moved counts the sectors this server's sweep re-sealed, Unreadable those it found
	// under neither key (damaged before: they stay I/O errors).
	Moved      uint64 `json:"moved"`
	Unreadable uint64 `json:"unreadable,omitempty"`
	// BytesPerSecond is the sweep's rate over the last few seconds, and Remaining the
	// time left at that rate (0 when not known).
	BytesPerSecond float64       `json:"bytes_per_second,omitempty"`
	Remaining      time.Duration `json:"remaining_ns,omitempty"`
	Started        time.Time     `json:"started,omitzero"`
	Finished       time.Time     `json:"finished,omitzero"`
	Error          string        `json:"error,omitempty"`
}

// Percent is how much of the volume is under the new key.
func (r *ReencryptStatus) Percent() float64 {
	if r.State == ReencryptDone || r.Sectors == 0 {
		return 100
	}
	return 100 * float64(r.Cursor) / float64(r.Sectors)
}

// ReencryptOptions say how an attached volume's sweep runs.
type ReencryptOptions struct {
	// MaxRate bounds the sweep to about this many bytes a second (0: as fast as the
	// clients leave room for). A re-encryption that the next attach resumes runs with
	// Config.ReencryptMaxRate.
	MaxRate int64 `json:"max_rate,omitempty"`
}

// reencryption is the volume's re-encryption in this server.
type reencryption struct {
	on      *reencrypt.Online
	cancel  context.CancelFunc // of the running sweep
	done    chan struct{}      // closed when the running sweep has returned
	started time.Time

	mu       sync.Mutex
	running  bool
	err      error
	last     blockdev.ReencryptStatus
	finished time.Time
	samples  []progressSample // for the rate, the last rateWindow of them
}

type progressSample struct {
	at     time.Time
	cursor uint64
}

// rateWindow is how far back the rate in the status looks.
const rateWindow = 10 * time.Second

// Reencrypt begins a re-encryption of v, prepared from its header by the process that
// holds the credentials (keys.PrepareReencrypt): it writes the header's start, gives
// the device the new key, and starts the sweep, which runs while v serves. It returns
// once the sweep has started; Status follows it. A re-encryption under way is refused
// (keys.ErrReencrypting), and so is a read-only, onetime or failed volume. pr stays the
// caller's to wipe.
func (v *Volume) Reencrypt(pr *keys.PreparedReencrypt, o ReencryptOptions) error {
	v.keyMu.Lock() // the device's keys change: not while a suspend wipes them
	defer v.keyMu.Unlock()
	v.reMu.Lock()
	defer v.reMu.Unlock()
	if err := v.canReencrypt(); err != nil {
		return err
	}
	if r := v.dev.Reencryption(); r.Active {
		return fmt.Errorf("%w (%.1f%%): wait for it, or see 'eli status'", keys.ErrReencrypting, 100*float64(r.Cursor)/float64(max(r.Sectors, 1)))
	}
	on, next, err := reencrypt.StartOnline(v.p, v.dev, pr)
	if err != nil {
		return err
	}
	v.codecs = append(v.codecs, next)
	v.setMode(on.To)
	v.log.Info("re-encryption started", "from", on.From.String(), "to", on.To.String(), "epoch", on.Epoch)
	v.runReencrypt(on, o)
	return nil
}

// ResumeReencrypt starts the sweep of a re-encryption under way that is not running:
// one whose sweep failed, or that Open found (Start resumes that one by itself).
// ErrReencrypting if it runs; keys.ErrNotReencrypting if none is under way.
func (v *Volume) ResumeReencrypt(o ReencryptOptions) error {
	v.reMu.Lock()
	defer v.reMu.Unlock()
	if err := v.canReencrypt(); err != nil {
		return err
	}
	re := v.re
	if re == nil || re.on == nil || !v.dev.Reencryption().Active {
		return fmt.Errorf("%w on the volume", keys.ErrNotReencrypting)
	}
	re.mu.Lock()
	running := re.running
	re.mu.Unlock()
	if running {
		return fmt.Errorf("%w, and its sweep runs: see 'eli status'", keys.ErrReencrypting)
	}
	v.log.Info("re-encryption resumed", "from", re.on.From.String(), "to", re.on.To.String(), "epoch", re.on.Epoch,
		"cursor", v.dev.Reencryption().Cursor)
	v.runReencrypt(re.on, o)
	return nil
}

// resumePending resumes the re-encryption that Open found under way, if any, with o:
// the server does so as soon as it serves.
func (v *Volume) resumePending(o ReencryptOptions) {
	v.reMu.Lock()
	defer v.reMu.Unlock()
	if v.re == nil || v.canReencrypt() != nil {
		return
	}
	v.log.Info("re-encryption resumed", "from", v.re.on.From.String(), "to", v.re.on.To.String(), "epoch", v.re.on.Epoch,
		"cursor", v.dev.Reencryption().Cursor)
	v.runReencrypt(v.re.on, o)
}

// Reencrypt begins a re-encryption of the served volume from a start prepared by
// another process: header is keys.PreparedReencrypt.Header, key the new master key
// (copied; the caller wipes its copy). See Volume.Reencrypt.
func (s *Server) Reencrypt(header, key []byte, o ReencryptOptions) error {
	if s.vol == nil {
		return errors.New("the server serves no volume yet")
	}
	pr, err := keys.ParsePrepared(header, key)
	if err != nil {
		return err
	}
	defer pr.Wipe()
	return s.vol.Reencrypt(pr, o)
}

// SetReencryptRate bounds the running sweep to about bytesPerSecond (0: no bound);
// keys.ErrNotReencrypting if none runs.
func (v *Volume) SetReencryptRate(bytesPerSecond int64) error {
	v.reMu.Lock()
	defer v.reMu.Unlock()
	if v.re == nil || !v.re.on.SetMaxRate(bytesPerSecond) {
		return fmt.Errorf("%w: no sweep runs", keys.ErrNotReencrypting)
	}
	v.log.Info("re-encryption rate", "max_bytes_per_second", bytesPerSecond)
	return nil
}

func (v *Volume) canReencrypt() error {
	switch {
	case v.ro:
		return errors.New("the volume is attached read-only: re-encrypt it attached read-write, or detached")
	case v.onetime:
		return errors.New("a onetime volume has no header and no key to change: detach it and attach it again for a new random key")
	case v.closing:
		return ErrStopping
	case v.suspended():
		return fmt.Errorf("%w: resume it first ('eli resume')", blockdev.ErrSuspended)
	}
	if err := v.Err(); err != nil {
		return fmt.Errorf("the volume failed (%v): detach it, attach it again, and re-encrypt then", err)
	}
	return nil
}

// ErrStopping: the server is stopping.
var ErrStopping = errors.New("the server is stopping")

// runReencrypt runs on's sweep in a goroutine until it ends or Close stops it. The
// caller holds reMu.
func (v *Volume) runReencrypt(on *reencrypt.Online, o ReencryptOptions) {
	re := v.re
	if re == nil || re.on != on {
		re = &reencryption{on: on, started: time.Now()}
		v.re = re
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	re.mu.Lock()
	re.cancel, re.done, re.running, re.err = cancel, done, true, nil
	re.last = v.dev.Reencryption()
	re.samples = append(re.samples[:0], progressSample{time.Now(), re.last.Cursor})
	re.mu.Unlock()
	cfg := v.sweep
	cfg.MaxRate = o.MaxRate
	cfg.OnProgress = func(st blockdev.ReencryptStatus) {
		re.progress(st)
		if v.onStep != nil {
			v.onStep(st)
		}
	}
	go func() {
		defer close(done)
		err := on.Run(ctx, cfg)
		re.mu.Lock()
		re.running = false
		switch {
		case err == nil:
			re.finished = time.Now()
		case ctx.Err() != nil:
			// Stopped by Close: where it stands is recorded for the next attach.
		default:
			re.err = err
		}
		re.mu.Unlock()
		switch {
		case err == nil:
			v.forgetPrevious()
			v.log.Info("re-encryption done: the old key is gone from the header and from memory", "epoch", on.Epoch,
				"moved", re.last.Moved, "took", time.Since(re.started).Round(time.Second))
		case ctx.Err() != nil:
			v.log.Info("re-encryption stopped: the next attach resumes it", "cursor", re.last.Cursor, "sectors", re.last.Sectors)
		default:
			v.log.Error("re-encryption stopped: 'eli reencrypt' resumes it", "err", err)
		}
	}()
}

// progress records a step's status (the sweep's goroutine).
func (re *reencryption) progress(st blockdev.ReencryptStatus) {
	re.mu.Lock()
	defer re.mu.Unlock()
	if !st.Active {
		return // the end: the device has forgotten the counts
	}
	re.last = st
	now := time.Now()
	re.samples = append(re.samples, progressSample{now, st.Cursor})
	i := 0
	for i < len(re.samples)-2 && now.Sub(re.samples[i+1].at) >= rateWindow {
		i++
	}
	re.samples = re.samples[i:]
}

// forgetPrevious wipes the previous keys once the device no longer holds them.
func (v *Volume) forgetPrevious() {
	v.keyMu.Lock()
	defer v.keyMu.Unlock()
	if len(v.codecs) > 1 { // none while suspended: the suspend wiped them all
		for _, c := range v.codecs[:len(v.codecs)-1] {
			c.Wipe()
		}
		v.codecs = v.codecs[len(v.codecs)-1:]
	}
	v.prev.Wipe()
	v.prev = nil
}

// suspended reports whether the volume is suspended.
func (v *Volume) suspended() bool {
	ok, _ := v.dev.Suspended()
	return ok
}

// stopReencrypt stops a running sweep at the end of its step, with a checkpoint, and
// wipes the key it kept (Close).
func (v *Volume) stopReencrypt() {
	v.reMu.Lock()
	v.closing = true
	re := v.re
	v.reMu.Unlock()
	if re == nil {
		return
	}
	re.mu.Lock()
	cancel, done := re.cancel, re.done
	re.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	re.on.Close()
}

// Reencryption is the re-encryption's part of Status: nil when there is none.
func (v *Volume) Reencryption() *ReencryptStatus {
	v.reMu.Lock()
	re := v.re
	v.reMu.Unlock()
	d := v.dev.Reencryption()
	if re == nil {
		if !d.Active {
			return nil
		}
		// Open found one under way, and this server does not sweep it.
		return &ReencryptStatus{State: ReencryptWaiting, From: v.prevMode.String(), To: v.Mode().String(), Epoch: v.epoch,
			Cursor: d.Cursor, Sectors: d.Sectors, SectorSize: v.dev.SectorSize()}
	}
	re.mu.Lock()
	defer re.mu.Unlock()
	st := &ReencryptStatus{
		Epoch: re.on.Epoch, From: re.on.From.String(), To: re.on.To.String(), Cursor: re.last.Cursor,
		Sectors: d.Sectors, SectorSize: v.dev.SectorSize(), Moved: re.last.Moved, Unreadable: re.last.Unreadable,
		Started: re.started, Finished: re.finished,
	}
	if d.Active {
		st.Cursor = d.Cursor
	}
	switch {
	case !re.finished.IsZero():
		st.State, st.Cursor = ReencryptDone, d.Sectors
	case v.suspended():
		st.State = ReencryptPaused
	case re.running:
		st.State = ReencryptRunning
	default:
		st.State = ReencryptStopped
		if re.err != nil {
			st.Error = re.err.Error()
		}
	}
	if st.State == ReencryptRunning && len(re.samples) >= 2 {
		a, b := re.samples[0], re.samples[len(re.samples)-1]
		if dt := b.at.Sub(a.at).Seconds(); dt > 0 && b.cursor > a.cursor {
			st.BytesPerSecond = float64(b.cursor-a.cursor) * float64(st.SectorSize) / dt
			left := float64(st.Sectors-st.Cursor) * float64(st.SectorSize)
			st.Remaining = time.Duration(left / st.BytesPerSecond * float64(time.Second))
		}
	}
	return st
}

package volume

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/wipe"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/reencrypt"
	"github.com/elidisk/eli/sector"
)

// Suspend and resume (geli's): the keys leave the server's memory while the volume
// stays attached, and requests wait for them. Volume.Suspend is blockdev's suspend
// (requests in flight finished, every write committed and flushed, every key wiped, new
// requests held); Server.Suspend first raises the kernel device's timeouts, so that the
// kernel waits for held requests instead of failing them.

// ErrOnetime: a onetime volume's key is random and held nowhere else, so a suspend
// would lose the volume for good.
var ErrOnetime = errors.New("a onetime volume cannot be suspended: its random key exists only in the server, and nothing could resume it")

// Suspend finishes the requests in flight, commits and flushes every write, holds a
// re-encryption's sweep between steps and records where it stands in the header, and
// wipes every key the volume holds (the re-encryption's master key included); requests from then on are
// held (they wait, they do not fail) until Resume. If ctx ends before the requests in
// flight finish, or the commit fails, nothing changes and the volume serves on.
func (v *Volume) Suspend(ctx context.Context) error {
	if v.onetime {
		return ErrOnetime
	}
	v.keyMu.Lock()
	defer v.keyMu.Unlock()
	if err := v.dev.Suspend(ctx); err != nil {
		return err
	}
	// The device wiped the codecs; the previous journal key's Secret is the volume's,
	// and the master key that a re-encryption keeps for the header is its Online's (the
	// device recorded the sweep's checkpoint with it, and holds the sweep until Resume).
	v.wipeKeys()
	if on := v.online(); on != nil {
		on.DropKey()
	}
	return nil
}

// online is the volume's re-encryption in this server, or nil.
func (v *Volume) online() *reencrypt.Online {
	v.reMu.Lock()
	defer v.reMu.Unlock()
	if v.re == nil {
		return nil
	}
	return v.re.on
}

// Resume reads the volume's header again, checks mk against it (an error wrapping
// keys.ErrWrongKey for another volume's key or a wrong one), derives the keys from it,
// and lets the held requests go in the order they came, and a re-encryption's sweep go
// on from where it stood (the previous keys derived again too). On an error the volume stays
// suspended and its requests held. mk stays the caller's to wipe.
func (v *Volume) Resume(mk *keys.MasterKey) error {
	v.keyMu.Lock()
	defer v.keyMu.Unlock()
	if ok, _ := v.dev.Suspended(); !ok {
		return blockdev.ErrNotSuspended
	}
	h, err := keys.Read(v.p)
	if err != nil {
		return fmt.Errorf("read the header again: %w", err)
	}
	if err := h.Verify(mk); err != nil {
		return err
	}
	if l := v.dev.Layout(); h.Mode != v.Mode() || h.Layout != l {
		return fmt.Errorf("the header no longer describes the attached volume (%s with %d sectors of %d bytes, now %s with %d of %d): "+
			"it was changed on the provider while the volume was attached", v.Mode(), l.Sectors, l.SectorSize, h.Mode, h.Layout.Sectors, h.Layout.SectorSize)
	}
	k, err := reencrypt.DeviceKeys(h, mk)
	if err != nil {
		return err
	}
	bk := blockdev.Keys{Codec: k.Codec, JournalKey: k.JournalKey.Bytes()}
	if k.Previous != nil {
		bk.Reencrypt = k.Reencrypt
	}
	// A re-encryption's sweep gets its master key back before the device lets it go on.
	on := v.online()
	if on != nil {
		err = on.TakeKey(mk)
	}
	if err == nil {
		err = v.dev.Resume(bk)
	}
	k.JournalKey.Wipe() // the device made its copies
	if err != nil {
		k.Codec.Wipe()
		k.Previous.Wipe()
		if on != nil {
			on.DropKey()
		}
		return err
	}
	v.codecs, v.prev = []sector.Codec{k.Codec}, k.Previous
	return nil
}

// Suspended reports whether the volume is suspended, and since when.
func (v *Volume) Suspended() (bool, time.Time) { return v.dev.Suspended() }

// wipeKeys wipes the keys the volume holds besides the device's: the codecs (which the
// device uses and does not own) and a re-encryption's previous keys.
func (v *Volume) wipeKeys() {
	for _, c := range v.codecs {
		c.Wipe()
	}
	v.codecs = nil
	v.prev.Wipe()
	v.prev = nil
}

// kernelDevice is what a suspend changes of the kernel device (nbdkernel.Device).
type kernelDevice interface {
	SetTimeout(time.Duration) error
	Close() error
}

// suspendedKernelTimeout is the kernel device's request and send timeout while the
// volume is suspended: the longest the kernel takes, since a suspend lasts as long as
// nobody resumes.
const suspendedKernelTimeout = nbdkernel.MaxTimeout

// kernelDrainPoll is how often Suspend looks whether the kernel device has requests in
// flight.
const kernelDrainPoll = 10 * time.Millisecond

// Suspend suspends the served volume (Volume.Suspend). With a kernel device it first
// raises the device's request and send timeouts, then answers as before until the
// device has had no request in flight once, so that every request the kernel started
// under the old timeout has its reply (a request keeps the timeout it started with:
// nbdkernel/timeout.go), and only then holds requests. If ctx ends first, or anything
// fails, the timeouts are put back and the volume serves on. Shutdown ends a suspend
// under way, and refuses one after it, with ErrStopping.
func (s *Server) Suspend(ctx context.Context) error {
	s.susMu.Lock()
	defer s.susMu.Unlock()
	if s.stopping {
		return ErrStopping
	}
	if s.vol == nil {
		return errors.New("the server serves no volume")
	}
	// Shutdown ends the suspend, which holds it up (susMu) as it waits for requests.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(s.stopped, cancel)()
	err := s.suspend(ctx)
	if err != nil && s.stopped.Err() != nil {
		return fmt.Errorf("%w: %w", ErrStopping, err)
	}
	return err
}

// suspend is Suspend under susMu, ctx ending at Shutdown too.
func (s *Server) suspend(ctx context.Context) error {
	if ok, _ := s.vol.Suspended(); ok {
		return blockdev.ErrSuspended
	}
	if s.vol.onetime {
		return ErrOnetime
	}
	if s.devIndex >= 0 && s.kdev == nil {
		// Without its sockets the send timeout cannot be raised: the kernel would fail
		// the requests held (connectKernel logged why they are not kept).
		return fmt.Errorf("%s: the server does not hold the kernel device's sockets, so it cannot raise their timeouts for a suspend; detach and attach again", s.cfg.Device)
	}
	if s.kdev != nil {
		if err := s.kdev.SetTimeout(suspendedKernelTimeout); err != nil {
			s.restoreKernelTimeout()
			return fmt.Errorf("raise the timeouts of %s for the suspend: %w", s.cfg.Device, err)
		}
		if err := s.drainKernel(ctx); err != nil {
			s.restoreKernelTimeout()
			return err
		}
	}
	if err := s.vol.Suspend(ctx); err != nil {
		s.restoreKernelTimeout()
		return err
	}
	if err := wipe.SignalFrames(); err != nil {
		s.log.Warn("suspend: the registers saved by the last signal to each thread may still hold key material", "err", err)
	}
	s.log.Info("suspended: every write is on the provider, the keys are wiped, and requests wait for 'eli resume'", "name", s.cfg.Name)
	return nil
}

// drainKernel waits until the kernel device has no request in flight.
func (s *Server) drainKernel(ctx context.Context) error {
	t := time.NewTicker(kernelDrainPoll)
	defer t.Stop()
	for {
		n, err := inFlight(s.devIndex)
		if err != nil {
			return fmt.Errorf("suspend: read the requests in flight on %s: %w", s.cfg.Device, err)
		}
		if n == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("suspend: %s never went without a request in flight, which it must once before requests are held "+
				"(the kernel would time out those it started under the old timeout): try again when it is less busy: %w", s.cfg.Device, ctx.Err())
		case <-t.C:
		}
	}
}

// inFlight is nbdkernel.InFlight; tests replace it.
var inFlight = nbdkernel.InFlight

// Resume resumes the suspended volume with mk (Volume.Resume), then puts the kernel
// device's timeouts back. On an error the volume stays suspended. Once Shutdown has
// begun it is refused with ErrStopping: the held requests fail as the volume closes.
func (s *Server) Resume(mk *keys.MasterKey) error {
	s.susMu.Lock()
	defer s.susMu.Unlock()
	if s.stopping {
		return ErrStopping
	}
	if s.vol == nil {
		return errors.New("the server serves no volume")
	}
	held := s.vol.dev.Held()
	if err := s.vol.Resume(mk); err != nil {
		return err
	}
	s.restoreKernelTimeout()
	s.log.Info("resumed", "name", s.cfg.Name, "held_requests", held)
	return nil
}

// restoreKernelTimeout puts the kernel device's timeouts back to what it was connected
// with; a failure is logged (the device then waits longer than it would, which fails
// nothing).
func (s *Server) restoreKernelTimeout() {
	if s.kdev == nil {
		return
	}
	if err := s.kdev.SetTimeout(time.Duration(s.cfg.kernelTimeout()) * time.Second); err != nil {
		s.log.Warn("put the kernel device's timeouts back", "device", s.cfg.Device, "err", err)
	}
}

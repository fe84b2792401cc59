package main

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/elidisk/eli/elidev"
	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/sdnotify"
)

// deviceAuto is --device's value that lets eli pick the device.
const deviceAuto = "auto"

// nameWait bounds the wait for udev to name the kernel device /dev/eli/NAME.
const nameWait = 10 * time.Second

// pickDevice resolves --device auto for a: the device that waits for this volume (after
// a restart or a crash), or a free one. release lets go of the claim on it once the
// device is connected. On failure it lets go of a as well.
func (a *attachment) pickDevice(sd daemon.StateDir) (release func(), err error) {
	if a.cfg.Device != deviceAuto {
		return func() {}, nil
	}
	dev, release, err := nbdkernel.Pick(nbdkernel.BackendID(a.cfg.VolumeID[:]), filepath.Join(sd.Path, "nbd-claims"))
	if err != nil {
		a.mk.Wipe()
		a.release()
		return nil, fmt.Errorf("--device auto: %w", err)
	}
	a.cfg.Device = dev
	return release, nil
}

// service is what 'eli attach --foreground' does for a supervisor (systemd's
// Type=notify services): say when the volume serves and when it stops, name its kernel
// device, and keep a device in use connected when stopped (daemon.Setup.KeepBusyDevice).
type service struct {
	cfg   *daemon.Setup
	log   *slog.Logger
	named *elidev.Named
}

// newService prepares cfg's server for supervision; ctx ends when it is asked to stop.
func newService(ctx context.Context, cfg *daemon.Setup, log *slog.Logger) *service {
	cfg.KeepBusyDevice = true
	go func() {
		<-ctx.Done()
		sdnotify.Notify(sdnotify.Stopping)
	}()
	return &service{cfg: cfg, log: log}
}

// ready runs once the export serves: it names the kernel device, then tells systemd.
func (s *service) ready(rec *daemon.Record) {
	status := "serving " + rec.URI
	if rec.Device != "" {
		n, err := elidev.System.Name(s.cfg.Name, rec.DeviceIdx, nbdkernel.BackendID(s.cfg.VolumeID[:]), nameWait)
		if err != nil {
			s.log.Warn("name the kernel device", "device", rec.Device, "err", err)
		}
		s.named = n
		status = fmt.Sprintf("serving %s on %s", s.cfg.Name, rec.Device)
		if n != nil {
			status += " (" + n.Link + ")"
		}
	}
	if _, err := sdnotify.Notify(sdnotify.Ready, sdnotify.Status(status)); err != nil {
		s.log.Warn("tell systemd that the volume is ready", "err", err)
	}
}

// stopped runs once the server has stopped.
func (s *service) stopped() { s.named.Release() }

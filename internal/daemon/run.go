package daemon

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"reflect"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/volume"
)

// statusEvery is how often the server looks whether its status changed, and so the
// most a status file lags behind (a failure is written at once).
const statusEvery = 250 * time.Millisecond

// DefaultStopTimeout bounds a server's shutdown when nobody said otherwise
// (StateDir.RequestStop): draining its connections and its final commit end by then,
// its requests to a remote provider cut short if the storage does not answer.
const DefaultStopTimeout = 30 * time.Second

// Run is a whole attachment's life: listen, open the volume on the unlocked provider p,
// serve it, record it in the state directory, keep its status there, answer the
// control socket (StateDir.ControlSocket: the operations of registerOps), and when ctx
// ends or a listener fails, stop: disconnect the kernel device, drain, close the volume,
// write the final status and remove what the attachment left in sd. mk is wiped once
// the volume is open.
//
// ready is called once clients can connect. An error returned before ready was called
// is the attach's failure; one returned after it is the server's final status (for
// example a final commit that the provider refused).
//
// The shutdown is bounded: by the deadline StateDir.RequestStop gave (eli detach), or
// DefaultStopTimeout after ctx ends; a remote provider's requests end by then (see
// volume.Server.Shutdown). Meanwhile the status says "stopping".
//
// The caller holds the name's lock and the provider's, and releases them after Run
// returns (the provider first: see StateDir); the record stays until the name's lock
// is released, so that a server that still runs is always listed.
func Run(ctx context.Context, cfg *Setup, sd StateDir, p provider.Provider, mk *keys.MasterKey, log *slog.Logger, ready func(*Record)) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctl, err := control.Listen(sd.ControlSocket(cfg.Name), log)
	if err != nil {
		mk.Wipe()
		return err
	}
	srv, err := volume.Start(&cfg.Config, p, mk, log)
	if err != nil {
		ctl.Close()
		return err
	}
	v, rec := srv.Volume(), newRecord(cfg, srv)
	if err := sd.WriteRecord(rec); err != nil {
		ctl.Close()
		srv.Shutdown(context.Background())
		sd.Cleanup(cfg.Name, rec, true)
		return err
	}
	sw := &statusWriter{sd: sd, v: v, name: cfg.Name, pid: rec.Pid, log: log}
	sw.write()
	registerOps(ctl, sw)
	registerSuspendOps(ctl, srv, &cfg.Config, sw)
	registerReencryptOps(ctl, srv, sw)
	ctlDone := make(chan struct{})
	go func() {
		defer close(ctlDone)
		if err := ctl.Serve(); err != nil {
			log.Warn("the control socket stopped answering", "err", err)
		}
	}()
	ready(rec)

	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		sw.run(done)
	}()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if cfg.Device != "" {
		// SIGUSR1 ('eli detach --keep-device') stops the server as ctx does, but leaves
		// the kernel device connected for the next attach to re-plug.
		usr1 := make(chan os.Signal, 1)
		signal.Notify(usr1, syscall.SIGUSR1)
		defer signal.Stop(usr1)
		go func() {
			select {
			case <-usr1:
				srv.KeepDevice()
				cancel()
			case <-ctx.Done():
			}
		}()
	}
	werr := srv.Wait(ctx)
	if cfg.KeepBusyDevice {
		srv.KeepDeviceIfBusy()
	}
	sw.stopping.Store(true)
	sw.write()
	sctx, scancel := context.WithDeadline(context.Background(), sd.stopDeadline(cfg.Name, DefaultStopTimeout))
	serr := srv.Shutdown(sctx)
	scancel()
	// The control socket answers while the server stops (status says "stopping"), and
	// goes once the volume is closed.
	ctl.Close()
	<-ctlDone
	close(done)
	<-stopped

	final := sw.final(serr)
	if werr != nil && serr == nil {
		serr = werr
	}
	// Clients can no longer connect. A server that failed, or whose witness is behind,
	// keeps its status and log for the user; the next attach removes them. The record
	// goes with the name's lock (NameLock.Release).
	removeIfSocket(cfg.Socket)
	removeIfSocket(sd.File(cfg.Name, ".sock"))
	if !final.Failed() && final.Witness == "" {
		os.Remove(sd.File(cfg.Name, ".status"))
		os.Remove(sd.File(cfg.Name, ".log"))
		os.Remove(sd.File(cfg.Name, ".log.1"))
	}
	return serr
}

// statusWriter keeps NAME.status current.
type statusWriter struct {
	sd       StateDir
	v        *volume.Volume
	name     string
	pid      int
	log      *slog.Logger
	stopping atomic.Bool

	mu   sync.Mutex // put, from the writer goroutine and from Run
	last volume.Status
}

func (w *statusWriter) snapshot() volume.Status {
	st := w.v.Status()
	st.Name, st.Pid = w.name, w.pid
	if w.stopping.Load() && st.State != volume.StateFailed {
		st.State = volume.StateStopping
	}
	return st
}

func (w *statusWriter) write() {
	st := w.snapshot()
	w.put(&st)
}

func (w *statusWriter) put(st *volume.Status) {
	w.mu.Lock()
	defer w.mu.Unlock()
	cmp := *st
	cmp.Updated = w.last.Updated
	if reflect.DeepEqual(cmp, w.last) && !w.last.Updated.IsZero() {
		return
	}
	st.Updated = time.Now()
	if err := w.sd.WriteStatus(st); err != nil {
		w.log.Warn("write status", "err", err)
		return
	}
	w.last = *st
}

// run rewrites the status when it changes, until done.
func (w *statusWriter) run(done <-chan struct{}) {
	t := time.NewTicker(statusEvery)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-w.v.Changed():
			w.write()
		case <-t.C:
			w.write() // Status notices a takeover without waiting for a write
		}
	}
}

// final writes the status of a stopped server whose Shutdown returned err.
func (w *statusWriter) final(err error) volume.Status {
	st := w.snapshot()
	st.State, st.Final = volume.StateStopped, "ok"
	if err != nil {
		st.Final = err.Error()
	}
	if f := w.v.Err(); f != nil {
		st.Error = f.Error()
	}
	st.Witness = w.v.WitnessProblem() // after Close: its last write
	w.put(&st)
	return st
}

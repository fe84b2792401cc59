package daemon

import (
	"context"
	"errors"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/volume"
)

// Operations of suspend and resume (volume.Server.Suspend and Resume) on the control socket.
const (
	// OpSuspend suspends the volume (Server.Suspend) within the call's deadline and
	// answers its Status. No arguments.
	OpSuspend = "suspend"
	// OpResume resumes it with the master key, the call's secret part (the caller ran
	// the KDF), and answers its Status. No arguments.
	OpResume = "resume"
)

// Codes of the suspend and resume operations' errors.
const (
	CodeSuspended    control.Code = "suspended"     // suspend of a suspended volume
	CodeNotSuspended control.Code = "not-suspended" // resume of a volume that serves
	CodeWrongKey     control.Code = "wrong-key"     // the key is not the volume's: it stays suspended
	CodeOnetime      control.Code = "onetime"       // a onetime volume cannot be suspended
	CodeStopping     control.Code = "stopping"      // the server is stopping: nothing is suspended or resumed
)

// registerSuspendOps makes ctl answer suspend and resume for srv.
func registerSuspendOps(ctl *control.Server, srv *volume.Server, cfg *volume.Config, sw *statusWriter) {
	status := func() volume.Status { return sw.snapshot() }
	ctl.Register(OpSuspend, func(ctx context.Context, req *control.Request) (any, error) {
		err := srv.Suspend(ctx)
		sw.write()
		switch {
		case errors.Is(err, blockdev.ErrSuspended):
			return nil, control.Errorf(CodeSuspended, "%s is suspended already", cfg.Name)
		case errors.Is(err, volume.ErrOnetime):
			return nil, control.Errorf(CodeOnetime, "%s: %v", cfg.Name, err)
		case errors.Is(err, volume.ErrStopping):
			return nil, control.Errorf(CodeStopping, "%s is being detached: not suspended", cfg.Name)
		case err != nil:
			return nil, err
		}
		return status(), nil
	})
	ctl.Register(OpResume, func(ctx context.Context, req *control.Request) (any, error) {
		mk, err := keys.NewMasterKey(cfg.VolumeID, req.Secret)
		if err != nil {
			return nil, control.Errorf(control.CodeBadRequest, "resume: %v", err)
		}
		err = srv.Resume(mk)
		mk.Wipe()
		sw.write()
		switch {
		case errors.Is(err, blockdev.ErrNotSuspended):
			return nil, control.Errorf(CodeNotSuspended, "%s is not suspended", cfg.Name)
		case errors.Is(err, volume.ErrStopping):
			return nil, control.Errorf(CodeStopping, "%s is being detached: the requests it holds fail; "+
				"every write acknowledged before the suspend is on the provider", cfg.Name)
		case errors.Is(err, keys.ErrWrongKey) || errors.Is(err, keys.ErrHeaderTampered):
			// A master key of this volume ID that is not the volume's fails the
			// header's MAC, as a changed header does: either way it is not the key.
			return nil, control.Errorf(CodeWrongKey, "%s: the key is not the one of the volume's header; it stays suspended", cfg.Name)
		case err != nil:
			return nil, err
		}
		return status(), nil
	})
}

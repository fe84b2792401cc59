package daemon

import (
	"context"
	"errors"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/volume"
)

// OpReencrypt starts the re-encryption of the served volume (volume.Server.Reencrypt,
// with ReencryptArgs; the new master key is the request's secret), resumes one under way
// whose sweep stopped, or changes the rate of one that runs. It answers the
// re-encryption's status (volume.ReencryptStatus).
const OpReencrypt = "reencrypt"

// ReencryptArgs are OpReencrypt's arguments.
type ReencryptArgs struct {
	// Header is a start prepared from the volume's header by keys.PrepareReencrypt (its
	// Header), whose new master key is the request's secret. Empty with Resume.
	Header []byte `json:"header,omitempty"`
	// Resume starts the sweep of the re-encryption under way, which has stopped.
	Resume bool `json:"resume,omitempty"`
	// SetRate changes only the MaxRate of the sweep that runs.
	SetRate bool `json:"set_rate,omitempty"`
	volume.ReencryptOptions
}

// Codes of OpReencrypt's refusals.
const (
	// CodeReencrypting: a re-encryption is under way (a new one is refused), or its
	// sweep runs (a resume is refused).
	CodeReencrypting control.Code = "reencrypting"
	// CodeNotReencrypting: a resume, with no re-encryption under way.
	CodeNotReencrypting control.Code = "not-reencrypting"
	// CodeHeaderChanged: the header was written since the start was prepared.
	CodeHeaderChanged control.Code = "header-changed"
)

// registerReencryptOps makes ctl answer OpReencrypt for srv.
func registerReencryptOps(ctl *control.Server, srv *volume.Server, sw *statusWriter) {
	ctl.Register(OpReencrypt, func(ctx context.Context, req *control.Request) (any, error) {
		var a ReencryptArgs
		if err := req.Decode(&a); err != nil {
			return nil, err
		}
		v := srv.Volume()
		var err error
		switch {
		case a.MaxRate < 0:
			return nil, control.Errorf(control.CodeBadRequest, "a negative rate")
		case (a.Resume || a.SetRate) && (len(a.Header) > 0 || len(req.Secret) > 0):
			return nil, control.Errorf(control.CodeBadRequest, "a resume or a rate takes no header and no key")
		case a.SetRate:
			err = v.SetReencryptRate(a.MaxRate)
		case a.Resume:
			err = v.ResumeReencrypt(a.ReencryptOptions)
		case len(a.Header) != keys.HeaderSize || len(req.Secret) != keys.MasterKeySize:
			return nil, control.Errorf(control.CodeBadRequest, "a start takes a %d-byte header and a %d-byte key (got %d and %d)",
				keys.HeaderSize, keys.MasterKeySize, len(a.Header), len(req.Secret))
		default:
			err = srv.Reencrypt(a.Header, req.Secret, a.ReencryptOptions)
		}
		sw.write()
		switch {
		case err == nil:
			return v.Reencryption(), nil
		case errors.Is(err, keys.ErrReencrypting):
			return nil, control.Errorf(CodeReencrypting, "%v", err)
		case errors.Is(err, keys.ErrNotReencrypting):
			return nil, control.Errorf(CodeNotReencrypting, "%v", err)
		case errors.Is(err, keys.ErrHeaderChanged):
			return nil, control.Errorf(CodeHeaderChanged, "%v", err)
		}
		return nil, err
	})
}

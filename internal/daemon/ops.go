package daemon

import (
	"context"
	"time"

	"github.com/elidisk/eli/internal/control"
)

// Operations a running server answers on its control socket (control.Call).
const (
	// OpStatus answers the server's volume.Status as it is now (the status file lags it by up
	// to statusEvery). No arguments.
	OpStatus = "status"
)

// registerOps makes ctl answer the running server's operations.
func registerOps(ctl *control.Server, sw *statusWriter) {
	ctl.Register(OpStatus, func(ctx context.Context, req *control.Request) (any, error) {
		st := sw.snapshot()
		st.Updated = time.Now()
		return st, nil
	})
}

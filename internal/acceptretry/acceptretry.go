// Package acceptretry decides, for a server's accept loop, which failures of Accept to
// wait out and for how long. Running out of descriptors or memory passes; a server that
// returned on it would leave its socket bound with nobody accepting, and one that tried
// again at once would spin.
package acceptretry

import (
	"errors"
	"net"
	"syscall"
	"time"
)

// Transient reports whether an Accept that failed with err may succeed later.
func Transient(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM) ||
		errors.Is(err, syscall.ECONNABORTED)
}

// Backoff is the wait after a transient failure, as net/http waits: 5 ms, doubled after
// each failure in a row, at most a second. The zero value is ready; Reset after an
// Accept that succeeds.
type Backoff struct{ d time.Duration }

// Next is how long to wait after one more failure in a row.
func (b *Backoff) Next() time.Duration {
	b.d = min(max(2*b.d, minWait), maxWait)
	return b.d
}

// Reset starts the waits over.
func (b *Backoff) Reset() { b.d = 0 }

const (
	minWait = 5 * time.Millisecond
	maxWait = time.Second
)

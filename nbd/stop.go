package nbd

import (
	"sync"
	"sync/atomic"
	"time"
)

// shutdownDrain is how long a stopping connection keeps reading requests (or options) the
// client had already sent, to answer them with ESHUTDOWN (NBD_REP_ERR_SHUTDOWN) instead
// of closing on them unread (which a client sees as a reset, losing replies it was owed).
const shutdownDrain = 250 * time.Millisecond

// stopper is how a connection is asked to end, and the read deadline that enforces it: a
// stopping connection's reader gives up waiting for budget at once and stops reading at
// stopAt, whatever deadline the reading of a payload would otherwise set.
type stopper struct {
	rd       interface{ SetReadDeadline(time.Time) error } // the connection as accepted
	done     chan struct{}                                 // closed to make a reader waiting for budget give up
	doneOnce sync.Once
	stopping atomic.Bool
	unread   atomic.Bool // handing over: leave requests not yet started unanswered
	dlMu     sync.Mutex  // orders read deadline changes against stop
	stopAt   time.Time   // guarded by dlMu: when a stopping connection stops reading
}

// stopAfter asks the reader to stop after drain.
func (st *stopper) stopAfter(drain time.Duration) {
	st.dlMu.Lock()
	st.stopping.Store(true)
	st.stopAt = time.Now().Add(drain)
	st.rd.SetReadDeadline(st.stopAt)
	st.dlMu.Unlock()
	st.closeDone()
}

// stopUnread asks a connection to end for a handover: requests in flight finish and are
// answered, and requests still arriving are left unanswered, for the client to send again
// to the server that takes over.
func (st *stopper) stopUnread() {
	st.unread.Store(true)
	st.stopAfter(0)
}

// setReadDeadline sets the read deadline, but never past a stopping connection's end.
func (st *stopper) setReadDeadline(t time.Time) {
	st.dlMu.Lock()
	defer st.dlMu.Unlock()
	if st.stopping.Load() && (t.IsZero() || t.After(st.stopAt)) {
		t = st.stopAt
	}
	st.rd.SetReadDeadline(t)
}

func (st *stopper) closeDone() { st.doneOnce.Do(func() { close(st.done) }) }

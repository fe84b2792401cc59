package nbdclient

import (
	"crypto/tls"
	"errors"
	"fmt"
	"syscall"
	"time"
)

// Options tune a Remote. The zero value is usable: every zero field takes its default.
type Options struct {
	// TLS replaces the TLS settings built from the URI (nbds:// only).
	TLS *tls.Config
	// DialTimeout bounds one connect and handshake (default 10s).
	DialTimeout time.Duration
	// RequestTimeout bounds a request's wait for its reply once it is on the wire
	// (default 30s). A request that outlives it takes its connection down, as a broken
	// one would: the pool reconnects and re-sends it, if its call may still wait
	// (QueueTimeout), and fails it with EIO otherwise.
	RequestTimeout time.Duration
	// QueueTimeout bounds a call in all: its waits for a connection, for room in flight
	// and for replies, across reconnections, which is how long a call may be held while
	// the server is away (dm-multipath's no_path_retry, open-iscsi's replacement_timeout).
	// A call that runs out fails with EIO. Zero (the default) is RequestTimeout: a call
	// fails once its request does. Forever holds calls until the server answers, or
	// until Close or SetDeadline (dm-multipath's queue_if_no_path).
	QueueTimeout time.Duration
	// Conns is how many connections to open when the server advertises
	// NBD_FLAG_CAN_MULTI_CONN (default 4; one otherwise).
	Conns int
	// MaxInFlight bounds the bytes of requests on the wire at once (default 64 MiB).
	MaxInFlight int64
	// ReplayLimit bounds the copies kept of acknowledged but not yet flushed writes, to
	// rewrite them after a reconnection (default 64 MiB; negative keeps none).
	ReplayLimit int64
	// BackoffMin and BackoffMax bound the wait between reconnection attempts, which
	// doubles from the first to the second (defaults 50ms and 2s).
	BackoffMin, BackoffMax time.Duration
	// SimpleReplies does not ask for structured replies.
	SimpleReplies bool
	// Logf, when set, is told of lost connections and reconnections.
	Logf func(format string, args ...any)
	// Verify, when set, checks every new pool of connections before anything is
	// re-sent on it, reading through read (which goes to the new server only): that the
	// export is still the one the caller was using, say, so that writes it had
	// acknowledged are not replayed onto another volume. An error stops the Remote for
	// good: every call then fails with it (wrapped with ErrExportChanged), and nothing
	// more is sent.
	Verify func(read func(p []byte, off int64) error) error
}

// Forever, as Options.QueueTimeout, holds calls for as long as the server is away.
const Forever time.Duration = -1

// callBound is how long a call may wait in all; 0 means without end.
func (o *Options) callBound() time.Duration {
	if o.QueueTimeout < 0 {
		return 0
	}
	return max(o.QueueTimeout, o.RequestTimeout)
}

// requeues reports whether a request that outlived RequestTimeout is re-sent on a new
// connection rather than failed with its call.
func (o *Options) requeues() bool { return o.QueueTimeout < 0 || o.QueueTimeout > o.RequestTimeout }

func (o *Options) fill() {
	def := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.DialTimeout, 10*time.Second)
	def(&o.RequestTimeout, 30*time.Second)
	def(&o.BackoffMin, 50*time.Millisecond)
	def(&o.BackoffMax, 2*time.Second)
	if o.Conns <= 0 {
		o.Conns = 4
	}
	if o.MaxInFlight <= 0 {
		o.MaxInFlight = 64 << 20
	}
	if o.ReplayLimit == 0 {
		o.ReplayLimit = 64 << 20
	}
}

var (
	errClosed = errors.New("nbd: client closed")
	// ErrDurability is what a Sync returns when a reconnection may have lost writes that
	// had been acknowledged but not flushed and were not kept for replay.
	ErrDurability = fmt.Errorf("nbd flush: reconnected to the server, and writes it acknowledged before were neither flushed nor kept for replay: %w", syscall.EIO)
	// ErrExportChanged is what every call returns once Options.Verify refused a new
	// connection's export.
	ErrExportChanged = fmt.Errorf("nbd: the export is not the one this client was using: %w", syscall.EIO)
	// ErrDeadline is what calls return once the deadline SetDeadline gave has passed.
	ErrDeadline = fmt.Errorf("nbd: deadline passed: %w", syscall.EIO)
)

// eio wraps why a request failed with EIO, so errors.Is(err, syscall.EIO) holds.
func eio(format string, a ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, a...), syscall.EIO)
}

package nbdclient

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// Remote is an NBD export as random-access storage (the method set of eli's
// provider.Provider, with the Punch of its Capabilities). It is safe for concurrent use: requests from all
// callers are pipelined over one or more connections, and a lost connection is
// re-established (see the package documentation for what is re-sent and in what order).
//
// Its parts: the connections (pool, pool.go), the calls' requests (requests,
// requests.go), what a reconnection must rewrite (replayLog, replay.go), and what holds
// a call back (flight and deadline, queue.go).
type Remote struct {
	target  Target
	opts    Options
	tlsCfg  *tls.Config
	size    atomic.Int64
	ctx     context.Context // canceled by Close, to stop a dial in progress
	cancel  context.CancelFunc
	closeCh chan struct{} // closed by Close

	flight   flight   // room in flight, under a lock of its own
	deadline deadline // SetDeadline's, under a lock of its own

	// mu guards closed and the three parts below, which change together: an answer
	// moves an op out of reqs and into log, a reconnection moves reqs and log onto a
	// new pool.
	mu     sync.Mutex
	closed bool
	pool   pool
	reqs   requests
	log    replayLog
}

// Open connects to the export an NBD URI names (ParseURI). opts may be nil.
func Open(uri string, opts *Options) (*Remote, error) {
	t, err := ParseURI(uri)
	if err != nil {
		return nil, err
	}
	return OpenTarget(t, opts)
}

// OpenTarget connects to t. The first connection is not retried: an unreachable server
// is an error here, while later losses are reconnected.
func OpenTarget(t Target, opts *Options) (*Remote, error) {
	r := &Remote{target: t, closeCh: make(chan struct{})}
	r.ctx, r.cancel = context.WithCancel(context.Background())
	if opts != nil {
		r.opts = *opts
	}
	r.opts.fill()
	r.flight.init(r.opts.MaxInFlight)
	r.deadline.init()
	r.reqs.init()
	r.log.limit = r.opts.ReplayLimit
	if t.TLS {
		r.tlsCfg = r.opts.TLS
		if r.tlsCfg == nil {
			cfg, err := t.tlsConfig()
			if err != nil {
				return nil, err
			}
			r.tlsCfg = cfg
		}
	}
	r.pool.gen = 1
	conns, exp, err := r.dialPool(r.pool.gen)
	if err != nil {
		r.cancel()
		return nil, err
	}
	r.mu.Lock()
	r.pool.start(conns, exp)
	r.size.Store(int64(exp.Size))
	r.mu.Unlock()
	// A connection that failed before the pool was up found nobody to reconnect it.
	for _, c := range conns {
		if err := c.failed(); err != nil {
			r.connDied(c, err)
			break
		}
	}
	if r.opts.requeues() {
		go r.watchdog()
	}
	return r, nil
}

// Health is the state of a Remote's connections, for status reports.
type Health struct {
	Connected     bool
	DownSince     time.Time     // when the connections were lost (zero while connected)
	LastError     error         // why, or the last failed attempt to reconnect since
	Reconnections int           // connections re-established after a loss
	Oldest        time.Duration // how long the oldest request in flight has waited
	Broken        error         // Verify refused the export (ErrExportChanged)
}

// Health reports the state of the connections.
func (r *Remote) Health() Health {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.pool.health()
	h.Oldest = r.reqs.oldest(time.Now())
	return h
}

// Export is what the server said about the export on the current connection.
func (r *Remote) Export() Export {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pool.export
}

// Target is where the Remote connects.
func (r *Remote) Target() Target { return r.target }

// String names the export as a URI (for messages).
func (r *Remote) String() string { return r.target.String() }

// Size is the export's size in bytes, as of the latest (re)connection.
func (r *Remote) Size() int64 { return r.size.Load() }

// Conns is how many connections are open.
func (r *Remote) Conns() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.pool.conns)
}

// Reconnections counts the connections re-established after a loss.
func (r *Remote) Reconnections() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pool.redials
}

func (r *Remote) logf(format string, args ...any) {
	if r.opts.Logf != nil {
		r.opts.Logf(format, args...)
	}
}

// ReadAt reads len(p) bytes at off; past the end of the export it reads what there is
// and returns io.EOF.
func (r *Remote) ReadAt(p []byte, off int64) (int, error) { return r.readAt(p, off, nil) }

// ReadAtContext is ReadAt, ending its waits with ctx (EIO when ctx ends first).
func (r *Remote) ReadAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	return r.readAt(p, off, ctx.Done())
}

// WriteAtContext is WriteAt, ending its waits with ctx.
func (r *Remote) WriteAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	return r.write(p, off, 0, ctx.Done())
}

// SyncContext is Sync, ending its wait with ctx.
func (r *Remote) SyncContext(ctx context.Context) error { return r.sync(ctx.Done()) }

func (r *Remote) readAt(p []byte, off int64, cancel <-chan struct{}) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("nbd read: negative offset: %w", syscall.EINVAL)
	}
	n := int64(len(p))
	eof := false
	if size := r.Size(); off+n > size {
		n, eof = max(size-off, 0), true
	}
	ops, err := r.split(nbdproto.CmdRead, 0, p, off, n)
	if err != nil {
		return 0, err
	}
	if err := r.do(ops, cancel); err != nil {
		return 0, err
	}
	if eof {
		return int(n), io.EOF
	}
	return int(n), nil
}

// WriteAt writes p at off.
func (r *Remote) WriteAt(p []byte, off int64) (int, error) { return r.write(p, off, 0, nil) }

// WriteAtFUA writes p at off, durable before it returns (NBD_CMD_FLAG_FUA where the
// server takes it, else a FLUSH after the write).
func (r *Remote) WriteAtFUA(p []byte, off int64) (int, error) {
	if r.Export().Flags&nbdproto.TflagSendFUA == 0 {
		if n, err := r.write(p, off, 0, nil); err != nil {
			return n, err
		}
		return len(p), r.Sync()
	}
	return r.write(p, off, nbdproto.CmdFlagFUA, nil)
}

func (r *Remote) write(p []byte, off int64, flags uint16, cancel <-chan struct{}) (int, error) {
	if r.Export().Flags&nbdproto.TflagReadOnly != 0 {
		return 0, fmt.Errorf("nbd write: export is read-only: %w", syscall.EPERM)
	}
	ops, err := r.split(nbdproto.CmdWrite, flags, p, off, int64(len(p)))
	if err != nil {
		return 0, err
	}
	if r.keepsWrites() && flags&nbdproto.CmdFlagFUA == 0 {
		for _, o := range ops {
			o.keep = getCopy(o.data)
		}
	}
	if err := r.do(ops, cancel); err != nil {
		return 0, err
	}
	return len(p), nil
}

// keepsWrites reports whether writes are copied for the replay log.
func (r *Remote) keepsWrites() bool {
	if r.opts.ReplayLimit < 0 {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pool.export.Flags&nbdproto.TflagSendFlush != 0 && r.log.keeps()
}

// Sync makes every completed write durable: it returns nil only after the server
// acknowledged an NBD_CMD_FLUSH sent after them (or, for a server that takes no flushes,
// at once: its writes are durable when acknowledged).
func (r *Remote) Sync() error { return r.sync(nil) }

func (r *Remote) sync(cancel <-chan struct{}) error {
	if r.Export().Flags&nbdproto.TflagSendFlush == 0 {
		return nil
	}
	return r.do([]*op{{cmd: nbdproto.CmdFlush}}, cancel)
}

// Punch makes [off, off+n) read as zeroes: NBD_CMD_WRITE_ZEROES (which lets the server
// punch a hole) where the export takes it, else written zeroes.
func (r *Remote) Punch(off, n int64) error {
	if n <= 0 {
		return nil
	}
	if r.Export().Flags&nbdproto.TflagSendWriteZeroes == 0 {
		zero := make([]byte, min(n, 1<<20))
		for n > 0 {
			l := min(n, int64(len(zero)))
			if _, err := r.WriteAt(zero[:l], off); err != nil {
				return err
			}
			off, n = off+l, n-l
		}
		return nil
	}
	ops, err := r.split(nbdproto.CmdWriteZeroes, 0, nil, off, n)
	if err != nil {
		return err
	}
	return r.do(ops, nil)
}

// Trim tells the server [off, off+n) is unused (NBD_CMD_TRIM); its contents are
// unspecified afterwards. A server that takes no trims ignores it.
func (r *Remote) Trim(off, n int64) error {
	if n <= 0 || r.Export().Flags&nbdproto.TflagSendTrim == 0 {
		return nil
	}
	ops, err := r.split(nbdproto.CmdTrim, 0, nil, off, n)
	if err != nil {
		return err
	}
	return r.do(ops, nil)
}

// Close disconnects. Calls in progress fail.
func (r *Remote) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	close(r.closeCh)
	r.cancel()
	conns := r.pool.conns
	done := r.pool.reconnDone
	r.mu.Unlock()
	// Readers first: once they are gone, no reply can land in a caller's buffer.
	for _, c := range conns {
		c.disconnect()
	}
	if done != nil {
		<-done
	}
	r.mu.Lock()
	for o := range r.reqs.pending {
		r.finish(o, errClosed)
	}
	r.mu.Unlock()
	return nil
}

package nbd

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/elidisk/eli/internal/acceptretry"
)

// Defaults for Server's limits.
const (
	DefaultMaxConns           = 64
	DefaultMaxHandshakes      = 16
	DefaultMaxConnsPerSource  = 16
	DefaultMaxInFlightPerConn = 64
	DefaultMaxInFlight        = 256
	DefaultMaxBytesPerConn    = 64 << 20
	DefaultMaxBytes           = 256 << 20
	DefaultHandshakeTimeout   = 10 * time.Second
	DefaultIOTimeout          = 30 * time.Second
)

// minTransferRate is the slowest a client may send a payload or take in a reply: on top
// of IOTimeout, a transfer of n bytes is given n / minTransferRate seconds.
const minTransferRate = 1 << 20

// ErrServerClosed is returned by Serve once Shutdown has been called.
var ErrServerClosed = errors.New("nbd: server closed")

// ErrInsecureListener is returned by Serve for a listener other than a unix socket when
// neither TLSConfig nor AllowInsecureTCP is set.
var ErrInsecureListener = errors.New("nbd: refusing to serve a network listener without TLS (set TLSConfig, or AllowInsecureTCP to opt in)")

// Server serves Exports over NBD (fixed newstyle handshake only) on any number of
// listeners. Fill in the fields, then call Serve; the fields must not change afterwards.
//
// Requests on one connection are processed concurrently and answered out of order. What
// they may hold is bounded per connection and over the whole server, in requests and in
// payload bytes; when a bound is reached the server stops reading from that client until
// replies drain, so a client can cost at most those bounds in memory. No client can stall
// the others with what it holds: each connection keeps a small reserve of the server's
// budget for itself (8 requests, 1 MiB); a larger request takes the shared rest if it has
// room, and is otherwise served in pieces under the reserve instead of waiting for it
// (stream.go); and a client that does not send a payload it announced at the pace
// IOTimeout and 1 MiB/s set, or does not read its replies, is disconnected and its budget
// returned.
type Server struct {
	// Exports are the exports offered; names are unique, "" is the default export.
	Exports []Export

	// TLSConfig, if set, makes the server FORCEDTLS (proto.md "TLS support"): before
	// NBD_OPT_STARTTLS every option but STARTTLS and ABORT is refused with
	// NBD_REP_ERR_TLS_REQD, and NBD_OPT_EXPORT_NAME ends the connection. Client
	// certificates are checked as the config says (see TLSConfigFromFiles). It applies to
	// every listener given to Serve; for a plain unix socket beside a TLS TCP port, run two
	// Servers over the same Exports.
	TLSConfig *tls.Config
	// AllowInsecureTCP lets Serve accept a non-unix listener without TLS: anyone who can
	// reach the port can then read and write the exports.
	AllowInsecureTCP bool

	// Logger gets one line per connection opened and closed and per notable event
	// (protocol violation, TLS failure, refused connection); never one per request.
	// Nil discards.
	Logger *slog.Logger

	// Limits; zero means the Default* value. Byte limits below MaxRequest are raised to
	// it, so that any legal request can proceed on its own.
	//
	// MaxConns bounds the connections open at once and MaxHandshakes those of them still
	// in the handshake (not yet proven to be NBD clients, and before TLS not yet
	// authenticated). When the handshakes are full, a new connection evicts the oldest
	// handshake of the source address that has the most of them, so idle sockets cannot
	// lock clients out; when all connections are in transmission and MaxConns is reached,
	// new ones are refused. MaxConnsPerSource bounds the connections from one IP address
	// (TCP only: a unix socket's peers are local and already bound by its 0600 mode); at
	// the bound, a new connection from that address evicts the address's oldest
	// handshake, and is refused only when all of them are in transmission.
	MaxConns           int
	MaxHandshakes      int
	MaxConnsPerSource  int
	MaxInFlightPerConn int
	MaxInFlight        int
	MaxBytesPerConn    int64
	MaxBytes           int64
	// HandshakeTimeout bounds the whole option haggling phase of a connection, TLS
	// handshake included.
	HandshakeTimeout time.Duration
	// IOTimeout bounds how long a client may take to send the payload of a WRITE and to
	// take in a reply, on top of the time its size needs at 1 MiB/s. A payload is paced:
	// its n-th MiB is due IOTimeout plus n seconds after it began, so a client that stops
	// part-way is dropped when its next MiB falls due, not when the whole would. (For a
	// reply, the deadline covers the whole write and is refreshed only when less than
	// half of IOTimeout is left, so a reply gets between IOTimeout/2 and IOTimeout.)
	// It bounds the client alone: a backend call may take as long as it takes (a
	// suspended volume holds requests until it resumes), and the time it takes, also
	// between the pieces of a streamed request, is not counted against the client.
	IOTimeout time.Duration

	// minRate overrides minTransferRate, and drainTime shutdownDrain, for tests.
	minRate   int64
	drainTime time.Duration
	// handOnAfter overrides the constant of that name (inline.go), for tests.
	handOnAfter time.Duration
	// onTakeOver, if set, runs when a goroutine has taken the reading over from a reader
	// whose inline request ran long, before it does anything else (tests).
	onTakeOver func()
	// gatherBound overrides the constant of that name (reply.go), for tests.
	gatherBound time.Duration

	// OnClients, if set, is told the number of connections in the transmission phase
	// (clients that chose an export) each time it changes, in order. It is called with
	// the server's lock held: it must return quickly and not call the Server.
	OnClients func(n int)

	initOnce sync.Once
	initErr  error
	table    *exportTable
	tls      *tls.Config // TLSConfig as served
	global   *limiter
	log      *slog.Logger

	mu        sync.Mutex
	shutdown  bool
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	evicting  int // evicted connections not yet gone
	clients   int // connections in transmission (OnClients)
	active    sync.WaitGroup
}

func (s *Server) init() error {
	s.initOnce.Do(func() {
		s.log = s.Logger
		if s.log == nil {
			s.log = slog.New(slog.DiscardHandler)
		}
		s.table, s.initErr = newExportTable(s.Exports)
		s.tls = gnutlsClientAuth(s.TLSConfig)
		s.global = newLimiter(s.maxInFlight(), s.maxBytes())
		s.listeners = make(map[net.Listener]struct{})
		s.conns = make(map[*conn]struct{})
	})
	return s.initErr
}

func orDefault[T int | int64 | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

func (s *Server) maxConns() int      { return orDefault(s.MaxConns, DefaultMaxConns) }
func (s *Server) maxHandshakes() int { return orDefault(s.MaxHandshakes, DefaultMaxHandshakes) }
func (s *Server) maxConnsPerSource() int {
	return orDefault(s.MaxConnsPerSource, DefaultMaxConnsPerSource)
}
func (s *Server) maxInFlightPerConn() int {
	return orDefault(s.MaxInFlightPerConn, DefaultMaxInFlightPerConn)
}
func (s *Server) maxInFlight() int { return orDefault(s.MaxInFlight, DefaultMaxInFlight) }
func (s *Server) maxBytesPerConn() int64 {
	return max(orDefault(s.MaxBytesPerConn, DefaultMaxBytesPerConn), MaxRequest)
}
func (s *Server) maxBytes() int64 { return max(orDefault(s.MaxBytes, DefaultMaxBytes), MaxRequest) }
func (s *Server) handshakeTimeout() time.Duration {
	return orDefault(s.HandshakeTimeout, DefaultHandshakeTimeout)
}

// transferDeadline is when a transfer of n bytes starting now must be done.
func (s *Server) transferDeadline(n int64) time.Time { return s.paceDeadline(time.Now(), n) }

// paceDeadline is when a transfer that began at start must have moved n bytes: IOTimeout
// for its beginning, then the minimum transfer rate.
func (s *Server) paceDeadline(start time.Time, n int64) time.Time {
	rate := orDefault(s.minRate, minTransferRate)
	return start.Add(orDefault(s.IOTimeout, DefaultIOTimeout) + time.Duration(n)*time.Second/time.Duration(rate))
}

// Serve accepts connections on l and serves them until Shutdown (then it returns
// ErrServerClosed) or until Accept fails for good, for instance because someone else
// closed l; connections already open then go on until they end or Shutdown drains them.
// It does not close l on an Accept error.
func (s *Server) Serve(l net.Listener) error {
	if err := s.init(); err != nil {
		return err
	}
	if l.Addr().Network() != "unix" && s.TLSConfig == nil && !s.AllowInsecureTCP {
		return ErrInsecureListener
	}
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		return ErrServerClosed
	}
	s.listeners[l] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
	}()

	var backoff acceptretry.Backoff
	for {
		nc, err := l.Accept()
		if err != nil {
			if s.closing() {
				return ErrServerClosed
			}
			if !acceptretry.Transient(err) {
				return fmt.Errorf("nbd: accept on %s: %w", l.Addr(), err)
			}
			wait := backoff.Next()
			s.log.Warn("nbd: accept failed, retrying", "listener", l.Addr().String(), "err", err, "retry_in", wait)
			time.Sleep(wait)
			continue
		}
		backoff.Reset()
		s.mu.Lock()
		if s.shutdown {
			s.mu.Unlock()
			nc.Close()
			return ErrServerClosed
		}
		c := newConn(s, nc)
		if reason := s.admitLocked(c); reason != "" {
			s.mu.Unlock()
			s.log.Warn("nbd: connection refused", "remote", c.remote, "reason", reason)
			nc.Close()
			continue
		}
		s.mu.Unlock()
		go c.serve()
	}
}

// admitLocked decides whether c may be served, making room if need be, and registers it;
// it returns why not otherwise.
func (s *Server) admitLocked(c *conn) string {
	if c.source != "" {
		live, oldest := 0, (*conn)(nil)
		for o := range s.conns {
			if o.source != c.source || o.evicted {
				continue
			}
			live++
			if !o.inTransmission && (oldest == nil || o.start.Before(oldest.start)) {
				oldest = o
			}
		}
		if live >= s.maxConnsPerSource() {
			// Hosts behind one NAT, or clients on one machine, share an address: its
			// idle handshakes give way to a newcomer, as the server's do (below), so
			// that they cannot lock out a neighbour who completes its handshake.
			if oldest == nil {
				return fmt.Sprintf("%d connections from %s in transmission already (MaxConnsPerSource)", live, c.source)
			}
			s.evictLocked(oldest, "max_conns_per_source", s.maxConnsPerSource())
		}
	}
	handshakes := 0
	for o := range s.conns {
		if !o.inTransmission && !o.evicted {
			handshakes++
		}
	}
	live := len(s.conns) - s.evicting
	if handshakes >= s.maxHandshakes() || live >= s.maxConns() {
		v := s.evictionVictimLocked()
		if v == nil {
			return fmt.Sprintf("%d connections in transmission (MaxConns)", live)
		}
		s.evictLocked(v, "max_handshakes", s.maxHandshakes())
	}
	s.conns[c] = struct{}{}
	s.active.Add(1)
	return ""
}

// evictLocked closes a connection in the handshake to admit a new one; bound names the
// limit that made it necessary, for the log.
func (s *Server) evictLocked(v *conn, bound string, limit int) {
	v.evicted = true
	s.evicting++
	v.log.Warn("nbd: handshake evicted to admit a new connection", bound, limit)
	v.nc.Close()
}

// evictionVictimLocked picks the connection in the handshake to drop for a new one: the
// oldest of the source address that has the most handshakes open, so that one address
// cannot push everyone else out.
func (s *Server) evictionVictimLocked() *conn {
	per := make(map[string]int)
	for o := range s.conns {
		if !o.inTransmission && !o.evicted {
			per[o.source]++
		}
	}
	var v *conn
	for o := range s.conns {
		if o.inTransmission || o.evicted {
			continue
		}
		if v == nil || per[o.source] > per[v.source] || (per[o.source] == per[v.source] && o.start.Before(v.start)) {
			v = o
		}
	}
	return v
}

func (s *Server) closing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shutdown
}

// enterTransmission moves c out of the handshake unless the server is shutting down. It
// runs before the reply that ends the handshake is sent, so that a client that has its
// export is never taken for an idle handshake to evict.
func (s *Server) enterTransmission(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shutdown {
		return false
	}
	c.inTransmission = true
	s.clients++
	if s.OnClients != nil {
		s.OnClients(s.clients)
	}
	return true
}

func (s *Server) forget(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	if c.evicted {
		s.evicting--
	}
	if c.inTransmission {
		s.clients--
		if s.OnClients != nil {
			s.OnClients(s.clients)
		}
	}
	s.mu.Unlock()
	s.active.Done()
}

// Shutdown stops the server gracefully: it closes the listeners, answers options still
// arriving on connections in the handshake with NBD_REP_ERR_SHUTDOWN for a short while
// before closing them, and tells each connection in transmission to stop reading requests,
// finish and answer those in flight, flush its export's backend and close. It returns
// once every connection is gone, or with ctx's error when ctx ends first, after closing
// whatever was left. The backends are the caller's to close afterwards.
func (s *Server) Shutdown(ctx context.Context) error { return s.stopServing(ctx, false) }

// Handover stops the server as Shutdown does, except that requests a client sent which
// the server has not started are left unanswered instead of refused with ESHUTDOWN: a
// client that reconnects to a new server (the Linux kernel re-plugging /dev/nbdN) sends
// them again there, where ESHUTDOWN would have failed them.
func (s *Server) Handover(ctx context.Context) error { return s.stopServing(ctx, true) }

func (s *Server) stopServing(ctx context.Context, handover bool) error {
	_ = s.init() // a bad config only means nothing was ever served
	s.mu.Lock()
	s.shutdown = true
	for l := range s.listeners {
		l.Close()
	}
	for c := range s.conns {
		if c.inTransmission && handover {
			c.stopUnread()
		} else {
			c.stop() // in the handshake too: options then get NBD_REP_ERR_SHUTDOWN
		}
	}
	s.mu.Unlock()

	done := make(chan struct{})
	go func() {
		s.active.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		for c := range s.conns {
			c.abort()
		}
		s.mu.Unlock()
		return fmt.Errorf("nbd: shutdown: %w", ctx.Err())
	}
}

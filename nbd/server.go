package nbd

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"
)

// Defaults for Server's limits.
const (
	DefaultMaxConns           = 64
	DefaultMaxInFlightPerConn = 64
	DefaultMaxInFlight        = 256
	DefaultMaxBytesPerConn    = 64 << 20
	DefaultMaxBytes           = 256 << 20
	DefaultHandshakeTimeout   = 30 * time.Second
)

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
// replies drain, so a client can cost at most those bounds in memory.
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
	MaxConns           int
	MaxInFlightPerConn int
	MaxInFlight        int
	MaxBytesPerConn    int64
	MaxBytes           int64
	// HandshakeTimeout bounds the whole option haggling phase of a connection.
	HandshakeTimeout time.Duration

	initOnce sync.Once
	initErr  error
	table    *exportTable
	global   *limiter
	log      *slog.Logger

	mu        sync.Mutex
	shutdown  bool
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	active    sync.WaitGroup
}

func (s *Server) init() error {
	s.initOnce.Do(func() {
		s.log = s.Logger
		if s.log == nil {
			s.log = slog.New(slog.DiscardHandler)
		}
		s.table, s.initErr = newExportTable(s.Exports)
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

func (s *Server) maxConns() int { return orDefault(s.MaxConns, DefaultMaxConns) }
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

	var backoff time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			if s.closing() {
				return ErrServerClosed
			}
			if !transientAcceptError(err) {
				return fmt.Errorf("nbd: accept on %s: %w", l.Addr(), err)
			}
			// Out of file descriptors and the like: wait, as net/http does, rather
			// than spin or give up.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("nbd: accept failed, retrying", "listener", l.Addr().String(), "err", err, "retry_in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		s.mu.Lock()
		if s.shutdown {
			s.mu.Unlock()
			nc.Close()
			return ErrServerClosed
		}
		if len(s.conns) >= s.maxConns() {
			s.mu.Unlock()
			s.log.Warn("nbd: connection refused, too many connections", "remote", remoteName(nc), "max_conns", s.maxConns())
			nc.Close()
			continue
		}
		c := newConn(s, nc)
		s.conns[c] = struct{}{}
		s.active.Add(1)
		s.mu.Unlock()
		go c.serve()
	}
}

func transientAcceptError(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM) ||
		errors.Is(err, syscall.ECONNABORTED)
}

func (s *Server) closing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shutdown
}

// enterTransmission moves c out of the handshake unless the server is shutting down.
func (s *Server) enterTransmission(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shutdown {
		return false
	}
	c.inTransmission = true
	return true
}

func (s *Server) forget(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	s.active.Done()
}

// Shutdown stops the server gracefully: it closes the listeners, drops connections still
// in the handshake, and tells each connection in transmission to stop reading requests,
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
		} else if c.inTransmission {
			c.stop()
		} else {
			c.nc.Close()
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

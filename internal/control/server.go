package control

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/elidisk/eli/internal/acceptretry"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbd"
	"golang.org/x/sys/unix"
)

// Handler answers one operation. Its result is sent as JSON; an error is sent as its
// Code (an *Error's, or CodeFailed) and message. ctx ends at the caller's deadline (at
// most MaxCallTimeout), when the caller hangs up, or when the server closes.
type Handler func(ctx context.Context, req *Request) (any, error)

// Request is one call as a handler sees it.
type Request struct {
	Op   string
	Args json.RawMessage // null when the caller gave none
	// Secret is the request's secret part, nil if it had none. It lives in locked
	// memory outside the Go heap and is wiped when the handler returns: a handler that
	// keeps key material copies it into a keys.Secret of its own.
	Secret []byte
	// Peer is the calling process.
	Peer Peer
}

// Peer is the calling process, as the kernel says (SO_PEERCRED).
type Peer struct {
	PID int
	UID int
}

// Decode decodes the request's arguments into v, refusing fields v does not have: a
// caller that means something this server does not know is told so rather than
// half-obeyed.
func (r *Request) Decode(v any) error {
	if len(r.Args) == 0 {
		return Errorf(CodeBadRequest, "%s takes arguments", r.Op)
	}
	d := json.NewDecoder(bytes.NewReader(r.Args))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return Errorf(CodeBadRequest, "%s: arguments: %v", r.Op, err)
	}
	return nil
}

// Server answers the operations registered with it on a unix socket.
type Server struct {
	path string
	ln   net.Listener
	log  *slog.Logger
	uid  int
	sem  chan struct{}
	// ioTimeout is IOTimeout; tests shorten it.
	ioTimeout time.Duration

	mu       sync.Mutex
	handlers map[string]Handler

	ctx    context.Context // ends at Close: the handlers' parent
	cancel context.CancelFunc
	wg     sync.WaitGroup // connections being handled
	closed chan struct{}
	once   sync.Once
}

// Listen binds the control socket at path (mode 0600; a stale socket there is
// replaced, a live one is refused: nbd.ListenUnix). Serve answers on it.
func Listen(path string, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if limit := len(unix.RawSockaddrUnix{}.Path) - 1; len(path) > limit {
		return nil, fmt.Errorf("control socket %s: the path is %d bytes long, and a unix socket's may be %d at most: choose a shorter state directory",
			path, len(path), limit)
	}
	ln, err := nbd.ListenUnix(path)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{path: path, ln: ln, log: log, uid: os.Geteuid(), sem: make(chan struct{}, MaxConns), ioTimeout: IOTimeout,
		handlers: map[string]Handler{}, ctx: ctx, cancel: cancel, closed: make(chan struct{})}, nil
}

// Path is the socket's path.
func (s *Server) Path() string { return s.path }

// Register makes h answer op. It may be called while the server serves; registering
// an operation twice is a programming error and panics.
func (s *Server) Register(op string, h Handler) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.handlers[op]; dup {
		panic("control: operation " + op + " registered twice")
	}
	s.handlers[op] = h
}

func (s *Server) handler(op string) Handler {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.handlers[op]
}

// Serve answers connections until Close; it returns nil then, or why accepting failed
// for good. A failure that passes (out of file descriptors, of memory) is waited out:
// the socket stays bound, and a server that gave up would leave every later call, a
// resume among them, waiting on it for nothing.
func (s *Server) Serve() error {
	var backoff acceptretry.Backoff
	for {
		c, err := s.ln.Accept()
		if err != nil {
			select {
			case <-s.closed:
				return nil
			default:
			}
			if !acceptretry.Transient(err) {
				return fmt.Errorf("control socket: %w", err)
			}
			wait := backoff.Next()
			s.log.Warn("control: accept failed, retrying", "err", err, "retry_in", wait)
			select {
			case <-s.closed:
				return nil
			case <-time.After(wait):
			}
			continue
		}
		backoff.Reset()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serveConn(c.(*net.UnixConn))
		}()
	}
}

// Close stops accepting, ends the handlers' contexts and waits for them to return,
// and removes the socket.
func (s *Server) Close() error {
	var err error
	s.once.Do(func() {
		close(s.closed)
		err = s.ln.Close()
		s.cancel()
		s.wg.Wait()
	})
	return err
}

// allowed is the server's policy: root, or the user the server runs as.
func allowed(peerUID, serverUID int) bool { return peerUID == 0 || peerUID == serverUID }

func peerOf(c *net.UnixConn) (Peer, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return Peer{}, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Peer{}, err
	}
	if cerr != nil {
		return Peer{}, cerr
	}
	return Peer{PID: int(cred.Pid), UID: int(cred.Uid)}, nil
}

func (s *Server) serveConn(c *net.UnixConn) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(s.ioTimeout))
	peer, err := peerOf(c)
	if err != nil {
		s.log.Warn("control: cannot tell who connected", "err", err)
		s.answer(c, "", nil, Errorf(CodeDenied, "the caller's credentials cannot be read"))
		return
	}
	if !allowed(peer.UID, s.uid) {
		s.log.Warn("control: refused a caller that is neither root nor the server's user", "uid", peer.UID, "pid", peer.PID)
		s.answer(c, "", nil, Errorf(CodeDenied, "uid %d may not control this server (root or uid %d may)", peer.UID, s.uid))
		return
	}
	select {
	case s.sem <- struct{}{}:
		defer func() { <-s.sem }()
	default:
		s.answer(c, "", nil, Errorf(CodeBusy, "the server answers %d calls already: try again", MaxConns))
		return
	}

	req, sec, err := readRequest(c)
	defer sec.Wipe()
	if err != nil {
		s.log.Warn("control: bad request", "pid", peer.PID, "err", err)
		s.answer(c, "", nil, err)
		return
	}
	req.Peer = peer
	h := s.handler(req.Op)
	if h == nil {
		s.answer(c, req.Op, nil, Errorf(CodeUnknownOp, "this server does not know the operation %q (an older eli?)", req.Op))
		return
	}

	ctx, cancel := context.WithTimeout(s.ctx, req.timeout)
	defer cancel()
	// The caller sends nothing after its request: a read that returns means it hung
	// up (or broke the protocol), and the handler need not go on for it.
	c.SetReadDeadline(time.Time{})
	go func() {
		var b [1]byte
		c.Read(b[:])
		cancel()
	}()
	res, herr := h(ctx, &req.Request)
	sec.Wipe()
	req.Secret = nil
	if herr != nil {
		s.log.Info("control: operation failed", "op", req.Op, "pid", peer.PID, "err", herr)
	}
	s.answer(c, req.Op, res, herr)
}

// request is a Request being read, with the time its caller allows.
type request struct {
	Request
	timeout time.Duration
}

// readRequest reads one request; its secret part goes into sec, which the caller
// wipes (also on error).
func readRequest(c net.Conn) (*request, *keys.Secret, error) {
	b, err := readFrame(c, MaxMessage)
	if err != nil {
		return nil, nil, Errorf(CodeBadRequest, "read request: %v", err)
	}
	var h header
	if err := json.Unmarshal(b, &h); err != nil {
		return nil, nil, Errorf(CodeBadRequest, "request: %v", err)
	}
	if h.V != version {
		return nil, nil, Errorf(CodeBadRequest, "request of protocol version %d; this server speaks %d", h.V, version)
	}
	if h.Op == "" {
		return nil, nil, Errorf(CodeBadRequest, "request names no operation")
	}
	if h.Secret < 0 || h.Secret > MaxSecret {
		return nil, nil, Errorf(CodeBadRequest, "%s: a secret of %d bytes (at most %d)", h.Op, h.Secret, MaxSecret)
	}
	r := &request{Request: Request{Op: h.Op, Args: h.Args}, timeout: DefaultCallTimeout}
	if h.TimeoutMS > 0 {
		// Bounded before it is multiplied: a product past int64 wraps to a deadline
		// that has passed.
		r.timeout = time.Duration(min(h.TimeoutMS, MaxCallTimeout.Milliseconds())) * time.Millisecond
	}
	var sec *keys.Secret
	if h.Secret > 0 {
		sec = keys.NewSecret(h.Secret)
		if _, err := io.ReadFull(c, sec.Bytes()); err != nil {
			return nil, sec, Errorf(CodeBadRequest, "%s: read the secret: %v", h.Op, err)
		}
		r.Secret = sec.Bytes()
	}
	return r, sec, nil
}

// answer writes the reply to op: res, or err.
func (s *Server) answer(c net.Conn, op string, res any, err error) {
	var r wireReply
	if err != nil {
		r.Error = &wireError{Code: CodeFailed, Message: err.Error()}
		if ce := (*Error)(nil); errors.As(err, &ce) {
			r.Error.Code = ce.Code
		} else if errors.Is(err, context.DeadlineExceeded) {
			r.Error.Code = CodeTimeout // the caller's time ran out
		}
	} else if res != nil {
		b, merr := json.Marshal(res)
		if merr != nil {
			r.Error = &wireError{Code: CodeFailed, Message: fmt.Sprintf("encode the reply: %v", merr)}
		} else {
			r.Result = b
		}
	}
	b, _ := json.Marshal(r)
	if len(b) > MaxMessage {
		b, _ = json.Marshal(wireReply{Error: &wireError{Code: CodeFailed, Message: fmt.Sprintf("the reply of %d bytes is larger than %d", len(b), MaxMessage)}})
	}
	c.SetWriteDeadline(time.Now().Add(s.ioTimeout))
	if _, werr := c.Write(frame(b)); werr != nil {
		s.log.Warn("control: cannot send the reply", "op", op, "err", werr)
	}
}

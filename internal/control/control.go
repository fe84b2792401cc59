// Package control is a request/response channel between eli's commands and a running
// server: a unix socket in the state directory (NAME.ctl, mode 0600, beside NAME.sock)
// on which the server answers named operations that it registers (Server.Register),
// and that a command calls (Call).
//
// One request per connection:
//
//	request  u32 n (big-endian), n bytes of JSON {"v":1, "op", "args", "secret": m,
//	         "timeout_ms"}, then m bytes of secret
//	reply    u32 n, n bytes of JSON {"result"} or {"error": {"code", "message"}}
//
// Every length is bounded before it is trusted (MaxMessage, MaxSecret), every read and
// write has a deadline, and the server answers only its own user and root (SO_PEERCRED),
// at most MaxConns at a time. The secret part (key material a command derived) never
// goes into JSON, which a log might show: the client writes it from the caller's memory,
// the server reads it into locked memory outside the Go heap (keys.Secret), and wipes it
// once the handler returns.
//
// Errors cross the channel as values: a handler returns an *Error with a Code of its own
// choosing, or any error (CodeFailed), and the caller gets an *Error with that Code, to
// test with errors.Is against an *Error that has only a Code (ErrUnknownOp, ...).
package control

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"time"
)

// Ext is the control socket's suffix in the state directory: NAME.ctl.
const Ext = ".ctl"

// Bounds of what crosses the channel.
const (
	// MaxMessage bounds a request's or a reply's JSON.
	MaxMessage = 1 << 20
	// MaxSecret bounds a request's secret part.
	MaxSecret = 64 << 10
	// MaxConns bounds the connections a server handles at once; more are answered
	// CodeBusy at once.
	MaxConns = 8
	// IOTimeout bounds the reading of a whole request from its connection's accept, and
	// the writing of a reply: a client that sends slowly is dropped.
	IOTimeout = 5 * time.Second
	// DefaultCallTimeout bounds a call whose context has no deadline.
	DefaultCallTimeout = time.Minute
	// MaxCallTimeout bounds how long a handler may run, whatever the caller asked.
	MaxCallTimeout = 10 * time.Minute
)

// version is the protocol version a request carries.
const version = 1

// Code says what kind of failure an Error is. Handlers may use codes of their own.
type Code string

// The channel's own codes.
const (
	CodeNoServer   Code = "no-server"   // nothing answers on the socket (client side)
	CodeDenied     Code = "denied"      // the caller is neither root nor the server's user
	CodeBusy       Code = "busy"        // the server handles MaxConns calls already
	CodeUnknownOp  Code = "unknown-op"  // the server has no handler for the operation
	CodeBadRequest Code = "bad-request" // malformed, too large, or arguments that do not decode
	CodeProtocol   Code = "protocol"    // the reply is malformed, or the connection broke (client side)
	CodeTimeout    Code = "timeout"     // the call's deadline passed
	CodeFailed     Code = "failed"      // the handler failed with an error that has no code
)

// Error is a call's failure. Message is what the server said (empty for failures found
// on the client's side); Err is the local cause, if any, and never crosses the channel.
type Error struct {
	Op      string
	Code    Code
	Message string
	Err     error
}

func (e *Error) Error() string {
	msg := e.Message
	if msg == "" {
		msg = string(e.Code)
		if e.Err != nil {
			msg += ": " + e.Err.Error()
		}
	}
	if e.Op != "" {
		return "control " + e.Op + ": " + msg
	}
	return msg
}

func (e *Error) Unwrap() error { return e.Err }

// Is matches an *Error that has only a Code: errors.Is(err, ErrUnknownOp).
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && t.Op == "" && t.Message == "" && t.Err == nil
}

// Errorf is an error with a code, for a handler to return.
func Errorf(code Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// Targets for errors.Is.
var (
	ErrNoServer   = &Error{Code: CodeNoServer}
	ErrDenied     = &Error{Code: CodeDenied}
	ErrBusy       = &Error{Code: CodeBusy}
	ErrUnknownOp  = &Error{Code: CodeUnknownOp}
	ErrBadRequest = &Error{Code: CodeBadRequest}
	ErrProtocol   = &Error{Code: CodeProtocol}
	ErrTimeout    = &Error{Code: CodeTimeout}
	ErrFailed     = &Error{Code: CodeFailed}
)

// header is a request's JSON part.
type header struct {
	V         int             `json:"v"`
	Op        string          `json:"op"`
	Args      json.RawMessage `json:"args,omitempty"`
	Secret    int             `json:"secret,omitempty"` // the secret part's length
	TimeoutMS int64           `json:"timeout_ms,omitempty"`
}

// wireReply is a reply's JSON.
type wireReply struct {
	Result json.RawMessage `json:"result,omitempty"`
	Error  *wireError      `json:"error,omitempty"`
}

type wireError struct {
	Code    Code   `json:"code"`
	Message string `json:"message"`
}

// frame is b after its length.
func frame(b []byte) []byte {
	return append(binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(b)), uint32(len(b))), b...)
}

// readFrame reads a length and that many bytes, refusing more than limit.
func readFrame(r io.Reader, limit int) ([]byte, error) {
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return nil, err
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > uint32(limit) {
		return nil, fmt.Errorf("a message of %d bytes is larger than %d", size, limit)
	}
	b := make([]byte, size)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	return b, nil
}

package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"
)

// Call asks the server listening on socket to do op with args (nil for none, or a
// value that encodes as JSON) and secret (nil for none: key material, sent beside the
// JSON, never in it; the caller keeps and wipes its own copy), and decodes the result
// into result (nil to drop it). The call ends by ctx's deadline (DefaultCallTimeout
// without one), which the server's handler is given too.
//
// Its errors are *Error: CodeNoServer when nothing listens on socket, the server's code
// for what it refused or what failed, CodeTimeout, CodeProtocol.
func Call(ctx context.Context, socket, op string, args any, secret []byte, result any) error {
	fail := func(code Code, err error) error { return &Error{Op: op, Code: code, Err: err} }
	if len(secret) > MaxSecret {
		return fail(CodeBadRequest, fmt.Errorf("a secret of %d bytes (at most %d)", len(secret), MaxSecret))
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(DefaultCallTimeout)
	}
	h := header{V: version, Op: op, Secret: len(secret), TimeoutMS: max(time.Until(deadline).Milliseconds(), 1)}
	if args != nil {
		b, err := json.Marshal(args)
		if err != nil {
			return fail(CodeBadRequest, fmt.Errorf("encode the arguments: %w", err))
		}
		h.Args = b
	}
	hb, err := json.Marshal(h)
	if err != nil {
		return fail(CodeBadRequest, err)
	}
	if len(hb) > MaxMessage {
		return fail(CodeBadRequest, fmt.Errorf("a request of %d bytes (at most %d)", len(hb), MaxMessage))
	}

	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		if ctx.Err() != nil {
			return fail(CodeTimeout, ctx.Err())
		}
		return fail(CodeNoServer, err)
	}
	defer c.Close()
	c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	// The secret goes from the caller's memory to the socket: no copy of it is made.
	bufs := net.Buffers{frame(hb), secret}
	_, werr := bufs.WriteTo(c)
	// A server that refuses a caller answers before it reads the request, and may
	// close before it is all written: its answer is still there to read.
	b, rerr := readFrame(c, MaxMessage)
	switch {
	case rerr == nil:
	case ctx.Err() != nil:
		return fail(CodeTimeout, ctx.Err())
	case errors.Is(rerr, os.ErrDeadlineExceeded):
		return fail(CodeTimeout, context.DeadlineExceeded)
	case werr != nil:
		return fail(CodeProtocol, fmt.Errorf("send the request: %w", werr))
	default:
		return fail(CodeProtocol, fmt.Errorf("read the reply: %w", rerr))
	}
	var r wireReply
	if err := json.Unmarshal(b, &r); err != nil {
		return fail(CodeProtocol, fmt.Errorf("reply: %w", err))
	}
	if r.Error != nil {
		return &Error{Op: op, Code: r.Error.Code, Message: r.Error.Message}
	}
	if result != nil && len(r.Result) > 0 {
		if err := json.Unmarshal(r.Result, result); err != nil {
			return fail(CodeProtocol, fmt.Errorf("decode the result: %w", err))
		}
	}
	return nil
}

package nbd

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
	"unicode/utf8"

	"github.com/elidisk/eli/internal/nbdproto"
)

// OffsetError lets a backend say where inside a request it failed. A failed READ is then
// answered with NBD_REPLY_TYPE_ERROR_OFFSET carrying Offset (when structured replies are in
// use and Offset lies inside the request) rather than a bare NBD_REPLY_TYPE_ERROR, so a
// client can tell which part of a long read was bad.
type OffsetError struct {
	Offset int64 // absolute offset in the export
	Err    error
}

func (e *OffsetError) Error() string { return fmt.Sprintf("at offset %d: %v", e.Offset, e.Err) }
func (e *OffsetError) Unwrap() error { return e.Err }

// errnoTable maps the errno a backend error wraps to the NBD error value sent to the client
// (proto.md "Error values": EDQUOT and EFBIG SHOULD become ENOSPC). EROFS and EACCES are a
// refusal to write, which NBD spells EPERM.
var errnoTable = []struct {
	errno syscall.Errno
	nbd   uint32
}{
	{syscall.EPERM, nbdproto.EPerm},
	{syscall.EACCES, nbdproto.EPerm},
	{syscall.EROFS, nbdproto.EPerm},
	{syscall.EIO, nbdproto.EIO},
	{syscall.ENOMEM, nbdproto.ENoMem},
	{syscall.EINVAL, nbdproto.EInval},
	{syscall.ENOSPC, nbdproto.ENoSpc},
	{syscall.EDQUOT, nbdproto.ENoSpc},
	{syscall.EFBIG, nbdproto.ENoSpc},
	{syscall.EOVERFLOW, nbdproto.EOverflow},
	{syscall.ENOTSUP, nbdproto.ENotSup},
	{syscall.EOPNOTSUPP, nbdproto.ENotSup},
	{syscall.ESHUTDOWN, nbdproto.EShutdown},
}

// nbdError maps a backend error to an NBD error value; anything unrecognised is EIO, the
// one answer that never suggests the data is fine.
func nbdError(err error) uint32 {
	for _, e := range errnoTable {
		if errors.Is(err, e.errno) {
			return e.nbd
		}
	}
	return nbdproto.EIO
}

// errorName is for log lines and messages.
func errorName(code uint32) string {
	switch code {
	case nbdproto.EPerm:
		return "EPERM"
	case nbdproto.EIO:
		return "EIO"
	case nbdproto.ENoMem:
		return "ENOMEM"
	case nbdproto.EInval:
		return "EINVAL"
	case nbdproto.ENoSpc:
		return "ENOSPC"
	case nbdproto.EOverflow:
		return "EOVERFLOW"
	case nbdproto.ENotSup:
		return "ENOTSUP"
	case nbdproto.EShutdown:
		return "ESHUTDOWN"
	}
	return fmt.Sprintf("error %d", code)
}

// wireMessage makes s fit the spec's string rules for a message sent to the client: valid
// UTF-8, no NUL, and short (a human reads it; the log has the rest).
func wireMessage(s string) string {
	s = strings.ToValidUTF8(s, "?")
	s = strings.ReplaceAll(s, "\x00", "?")
	if len(s) <= maxErrorMessage {
		return s
	}
	cut := maxErrorMessage
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

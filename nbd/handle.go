package nbd

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/elidisk/eli/internal/nbdproto"
)

// zeroes is the source for WRITE_ZEROES when the backend cannot zero by itself. WriteAt
// must not modify its argument (io.WriterAt's rule), so one shared buffer serves all.
var zeroes [256 << 10]byte

// handle runs one checked request against the backend and answers it.
func (c *conn) handle(req *request) {
	if req.streamed {
		c.streamRead(req) // streamWrite runs in the reader
		c.answered(req)
		c.release(req)
		return
	}
	b := c.exp.Backend
	off := int64(req.off)
	n := int64(req.length)
	var err error
	switch req.typ {
	case nbdproto.CmdRead:
		if n == 0 {
			c.replyRead(req, nil)
			break
		}
		data := *req.buf
		if err = b.ReadAt(data, off); err == nil {
			c.replyRead(req, data)
		}
	case nbdproto.CmdWrite:
		c.wrote.Store(true)
		if k, ok := b.(Keeper); ok && n > 0 {
			buf := req.buf
			req.buf = nil // the backend's until it calls done
			err = k.WriteKeep(*buf, off, backendFlags(req.flags), func() { putBuf(buf) })
		} else if n > 0 {
			err = b.WriteAt(*req.buf, off, backendFlags(req.flags))
		}
	case nbdproto.CmdFlush:
		err = b.Flush()
	case nbdproto.CmdTrim:
		c.wrote.Store(true)
		if n > 0 {
			err = b.Trim(off, n, backendFlags(req.flags))
		}
		if errors.Is(err, syscall.ENOTSUP) {
			// TRIM is advisory (proto.md: "A server MAY discard ... but is not
			// required to"), so a backend that cannot trim has done what was asked.
			err = nil
		}
	case nbdproto.CmdWriteZeroes:
		c.wrote.Store(true)
		if n > 0 {
			err = c.writeZeroes(off, n, req.flags)
		}
	case nbdproto.CmdCache:
		if ca, ok := b.(Cacher); ok && n > 0 {
			err = ca.Cache(off, n)
		}
	case nbdproto.CmdBlockStatus:
		var ext []Extent
		if ext, err = c.extents(off, n, req.flags&nbdproto.CmdFlagReqOne != 0); err == nil {
			c.replyBlockStatus(req, ext)
		}
	}
	if err != nil {
		c.failed.Add(1)
		c.replyError(req, nbdError(err), err.Error(), errorOffset(err, off, n))
	} else if req.typ != nbdproto.CmdRead && req.typ != nbdproto.CmdBlockStatus {
		c.replyOK(req)
	}
	c.answered(req)
	c.release(req)
}

func backendFlags(f uint16) Flags {
	var b Flags
	if f&nbdproto.CmdFlagFUA != 0 {
		b |= FUA
	}
	if f&nbdproto.CmdFlagNoHole != 0 {
		b |= NoHole
	}
	if f&nbdproto.CmdFlagFastZero != 0 {
		b |= FastZero
	}
	return b
}

// writeZeroes asks the backend to zero the range. A backend that cannot (ENOTSUP) gets
// zeroes written through WriteAt instead, since without NBD_CMD_FLAG_FAST_ZERO the server
// MUST NOT fail with ENOTSUP (proto.md "NBD_CMD_WRITE_ZEROES"); with the flag, ENOTSUP is
// the fast answer the client asked for. It is also the answer, without asking the backend,
// for a range not aligned to the preferred block size: proto.md defines that size as the
// one below which I/O needs read-modify-write, which is no faster than writing zeroes.
func (c *conn) writeZeroes(off, n int64, flags uint16) error {
	if p := int64(c.exp.prefBlock); flags&nbdproto.CmdFlagFastZero != 0 && (off%p != 0 || n%p != 0) {
		return fmt.Errorf("zeroing %d bytes at offset %d, not aligned to the preferred block size %d, needs a read-modify-write: %w", n, off, p, syscall.ENOTSUP)
	}
	b := c.exp.Backend
	err := b.WriteZeroes(off, n, backendFlags(flags))
	if err == nil || flags&nbdproto.CmdFlagFastZero != 0 || !errors.Is(err, syscall.ENOTSUP) {
		return err
	}
	for n > 0 {
		k := min(n, int64(len(zeroes)))
		if err := b.WriteAt(zeroes[:k], off, 0); err != nil {
			return err
		}
		off += k
		n -= k
	}
	if flags&nbdproto.CmdFlagFUA != 0 {
		return b.Flush()
	}
	return nil
}

// maxExtents bounds the extents in one BLOCK_STATUS reply (64 KiB with extended headers);
// the client asks again from where the reply ends.
const maxExtents = 4096

// maxStatusReply is the most a BLOCK_STATUS reply can take, counted against the budgets.
const maxStatusReply = maxChunkHeader + 8 + 16*maxExtents

// extents asks the backend for the status of [off, off+n) and checks its answer: the
// extents must be contiguous from off and cover at least one byte. What reaches past n is
// cut; with reqOne only the first extent is kept. A backend without BlockStatuser has the
// whole range reported as data. Extent lengths never exceed n, so with compact headers
// (n < 4 GiB) they fit the reply's 32 bits.
func (c *conn) extents(off, n int64, reqOne bool) ([]Extent, error) {
	bs, ok := c.exp.Backend.(BlockStatuser)
	if !ok {
		return []Extent{{Length: n}}, nil
	}
	ext, err := bs.BlockStatus(off, n)
	if err != nil {
		return nil, err
	}
	var total int64
	for i, e := range ext {
		if e.Length <= 0 {
			return nil, fmt.Errorf("backend block status at offset %d: extent %d has length %d: %w", off, i, e.Length, syscall.EIO)
		}
		if e.Length >= n-total || i+1 == maxExtents || reqOne {
			ext[i].Length = min(e.Length, n-total)
			return ext[:i+1], nil
		}
		total += e.Length
	}
	if len(ext) == 0 {
		return nil, fmt.Errorf("backend block status at offset %d: no extents: %w", off, syscall.EIO)
	}
	return ext, nil
}

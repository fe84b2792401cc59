package nbd

import (
	"bufio"
	"encoding/binary"
	"errors"
	"log/slog"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// A READ or WRITE larger than a connection's reserve needs the shared pool, which other
// clients can hold: a WRITE whose header came and whose payload does not, a READ whose
// reply is not taken in. However quickly the server drops such clients, a request that
// waited for what they hold would wait for the slowest of them, and for every other
// waiter queued before it: clients that stall, reconnect and stall again can be queued
// ahead of it again and again. So a large request never waits for the shared pool. If
// the pool has room when it arrives, it takes what it needs and runs whole; if not, it
// is served in pieces of streamPiece under its connection's reserve, which no other
// client can take: a WRITE's payload is read and written to the backend a piece at a
// time, a READ is read from the backend and sent a piece at a time. Its latency is then
// its own transfer's and the backend's, whatever others do (fairness_test.go,
// TestStallersDoNotDelayLargeRequests). The price is paid only while the pool is full: a
// streamed WRITE reaches the backend as several writes, and a streamed READ holds the
// connection's reply writer while it runs.
//
// The other ways to the same end fall short. Dropping a WRITE whose payload arrives
// slower than a minimum rate frees the pool only after a grace that an honest client on
// a slow or lossy network needs too, and stallers queued ahead of a request are each
// granted the pool and given that grace in turn: with clients that reconnect, a large
// request waits for as many graces as stallers fit in the queue. Granting the pool in
// proportion to the payload that has arrived bounds what stallers hold by what they sent,
// but the buffer a request is read into is whole from the start, so the memory would no
// longer be bounded by the pool. The deadlines stay (readPayload, replyWriter): they give
// back what stalled clients hold, which only bounds memory and throughput now.

// streamPiece is the part of a streamed request in memory at a time: a quarter of a
// reserve, so that the connection's small requests still fit beside it.
const streamPiece = reserveBytes / 4

// streamWrite serves a WRITE in pieces (see above), in the reader, which owns the
// payload: each piece is read into a buffer of its own and written to the backend at its
// offset (with Keeper, the backend keeps the buffer as for any write), under the one
// streamPiece of budget req holds. FUA becomes a flush after the last piece, which covers
// them all. After a backend error the rest of the payload is read and dropped, and the
// error is the reply. It reports false, with a reason, when the connection must end: a
// payload that does not arrive in time ends it, as for any WRITE.
func (c *conn) streamWrite(br *bufio.Reader, req *request) (string, slog.Level, bool) {
	c.wrote.Store(true)
	b := c.exp.Backend
	k, keeps := b.(Keeper)
	off, n := int64(req.off), int64(req.length)
	start := time.Now() // the pieces keep the pace of one payload
	var err error
	for done := int64(0); done < n; {
		if err != nil {
			if e := c.skipPayload(br, n-done); e != nil {
				r := *req
				c.release(req)
				reason, level := c.payloadFailure(e, &r)
				return reason, level, false
			}
			break
		}
		m := min(n-done, streamPiece)
		buf := getBuf(int(m))
		if e := c.readPayload(br, *buf, start, done); e != nil {
			putBuf(buf)
			r := *req
			c.release(req)
			reason, level := c.payloadFailure(e, &r)
			return reason, level, false
		}
		called := time.Now()
		if keeps {
			err = k.WriteKeep(*buf, off+done, 0, func() { putBuf(buf) })
		} else {
			err = b.WriteAt(*buf, off+done, 0)
			putBuf(buf)
		}
		// The pace is the client's: the time the backend took (a suspended volume
		// holds a write for as long as it is suspended) does not count against it.
		start = start.Add(time.Since(called))
		if err != nil {
			err = offsetError(err, off+done)
		}
		done += m
	}
	if err == nil && req.flags&nbdproto.CmdFlagFUA != 0 {
		err = b.Flush()
	}
	req.arrived = time.Since(c.start)
	if err != nil {
		c.failed.Add(1)
		c.replyError(req, nbdError(err), err.Error(), errorOffset(err, off, n))
	} else {
		c.replyOK(req)
	}
	c.answered(req)
	c.release(req)
	return "", 0, true
}

// streamRead serves a READ in pieces (see above), in a worker, under the one streamPiece
// of budget req holds. The first piece is read before anything is sent, so that a
// failure there is answered as for any read. The reply is then one simple reply, or one
// data chunk, written a piece at a time with the reply writer held. A later failure of
// the backend cannot be told in a simple reply whose header said success: proto.md
// requires a hard disconnect then. In a chunk, the rest of it is sent as zeroes and an
// error chunk with the offset where they begin follows, as proto.md asks of an error
// detected while a chunk is being sent.
func (c *conn) streamRead(req *request) {
	b := c.exp.Backend
	buf := getBuf(streamPiece)
	defer putBuf(buf)
	off, n := int64(req.off), int64(req.length)
	p := (*buf)[:min(n, streamPiece)]
	if err := b.ReadAt(p, off); err != nil {
		c.failed.Add(1)
		c.replyError(req, nbdError(err), err.Error(), errorOffset(err, off, n))
		return
	}
	var h [maxChunkHeader + 8]byte
	hdr := h[:nbdproto.SimpleReplyHeaderLen]
	if c.structured {
		k := c.putChunkHeader(h[:], 0, nbdproto.ChunkOffsetData, req, 8+int(n))
		binary.BigEndian.PutUint64(h[k:], req.off)
		hdr = h[:k+8]
	} else {
		putSimpleHeader(h[:], 0, req.handle)
	}
	var failed error
	failedAt := int64(-1)
	err := c.out.stream(hdr, func(write func([]byte) error) error {
		if err := write(p); err != nil {
			return err
		}
		for done := int64(len(p)); done < n; {
			q := (*buf)[:min(n-done, streamPiece)]
			if failed == nil {
				if err := b.ReadAt(q, off+done); err != nil {
					if !c.structured {
						return err
					}
					failed, failedAt = err, off+done
				}
			}
			if failed != nil {
				q = zeroes[:len(q)]
			}
			if err := write(q); err != nil {
				return err
			}
			done += int64(len(q))
		}
		return nil
	})
	switch {
	case err != nil:
		if c.out.failure() == nil {
			c.log.Warn("nbd: a streamed read failed after its reply began; the connection is closed, as proto.md requires", "offset", off, "length", n, "err", err)
		}
		c.failed.Add(1)
		c.abort()
	case failed != nil:
		c.failed.Add(1)
		c.replyError(req, nbdError(failed), failed.Error(), failedAt)
	case c.structured:
		var d [maxChunkHeader]byte
		k := c.putChunkHeader(d[:], nbdproto.ReplyFlagDone, nbdproto.ChunkNone, req, 0)
		c.reply(req, d[:k], nil)
	}
}

// errorOffset is where in [off, off+n) err says a request failed, or -1.
func errorOffset(err error, off, n int64) int64 {
	var oe *OffsetError
	if errors.As(err, &oe) && oe.Offset >= off && oe.Offset < off+n {
		return oe.Offset
	}
	return -1
}

// offsetError makes sure err names an offset in the piece that began at off: the
// backend's own if it gave one, else the piece's start, so that the client learns how
// much of a streamed write went through.
func offsetError(err error, off int64) error {
	var oe *OffsetError
	if errors.As(err, &oe) {
		return err
	}
	return &OffsetError{Offset: off, Err: err}
}

package nbdclient

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// fakeExportSize is the size the fake server announces.
const fakeExportSize = 1 << 20

// fakeServer accepts connections on a unix socket, negotiates structured replies and one
// export, then answers every read request with reply(w, cookie, off, length), so a test
// can send what no well-behaved server would.
func fakeServer(t *testing.T, reply func(w io.Writer, cookie, off uint64, length uint32)) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go fakeConn(c, reply)
		}
	}()
	return "nbd+unix:///?socket=" + sock
}

func fakeConn(c net.Conn, reply func(w io.Writer, cookie, off uint64, length uint32)) {
	defer c.Close()
	if !fakeHandshake(c, nbdproto.TflagHasFlags|nbdproto.TflagSendFlush) {
		return
	}
	for {
		var h [28]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return
		}
		be := binary.BigEndian
		cmd, cookie, off, length := be.Uint16(h[6:]), be.Uint64(h[8:]), be.Uint64(h[16:]), be.Uint32(h[24:])
		if cmd != nbdproto.CmdRead {
			return
		}
		reply(c, cookie, off, length)
	}
}

// fakeHandshake plays the server's side of the handshake (structured replies, one
// export of fakeExportSize bytes with the given flags); false if the client went away.
func fakeHandshake(c net.Conn, flags uint16) bool {
	be := binary.BigEndian
	var b []byte
	b = be.AppendUint64(b, nbdproto.MagicNBD)
	b = be.AppendUint64(b, nbdproto.MagicOpt)
	b = be.AppendUint16(b, nbdproto.FlagFixedNewstyle|nbdproto.FlagNoZeroes)
	c.Write(b)
	var cflags [4]byte
	if _, err := io.ReadFull(c, cflags[:]); err != nil {
		return false
	}
	optReply := func(opt, typ uint32, data []byte) {
		var r []byte
		r = be.AppendUint64(r, nbdproto.MagicOptReply)
		r = be.AppendUint32(r, opt)
		r = be.AppendUint32(r, typ)
		r = be.AppendUint32(r, uint32(len(data)))
		c.Write(append(r, data...))
	}
	for {
		var h [16]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return false
		}
		opt, n := be.Uint32(h[8:]), be.Uint32(h[12:])
		if _, err := io.CopyN(io.Discard, c, int64(n)); err != nil {
			return false
		}
		if opt == nbdproto.OptStructuredReply {
			optReply(opt, nbdproto.RepAck, nil)
			continue
		}
		if opt != nbdproto.OptGo {
			optReply(opt, nbdproto.RepErrUnsup, nil)
			continue
		}
		var info []byte
		info = be.AppendUint16(info, nbdproto.InfoExport)
		info = be.AppendUint64(info, fakeExportSize)
		info = be.AppendUint16(info, flags)
		optReply(opt, nbdproto.RepInfo, info)
		optReply(opt, nbdproto.RepAck, nil)
		return true
	}
}

// chunk encodes one structured reply chunk.
func chunk(flags, typ uint16, cookie uint64, payload ...[]byte) []byte {
	be := binary.BigEndian
	p := bytes.Join(payload, nil)
	var b []byte
	b = be.AppendUint32(b, nbdproto.MagicStructuredReply)
	b = be.AppendUint16(b, flags)
	b = be.AppendUint16(b, typ)
	b = be.AppendUint64(b, cookie)
	b = be.AppendUint32(b, uint32(len(p)))
	return append(b, p...)
}

func u64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }
func u32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
func u16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

// TestStructuredReplies checks good replies in pieces (holes and data), error chunks, and
// that each malformed reply ends as EIO without reading more than the request allowed.
func TestStructuredReplies(t *testing.T) {
	t.Parallel()
	const done = nbdproto.ReplyFlagDone
	tests := []struct {
		name    string
		reply   func(w io.Writer, cookie, off uint64, n uint32)
		want    func(n int) []byte // nil: an error is expected
		errMsg  string             // the error's message must say this (server errors)
		healthy bool               // the connection survives (no reconnection)
	}{
		{name: "hole-then-data", healthy: true,
			reply: func(w io.Writer, c, off uint64, n uint32) {
				half := n / 2
				w.Write(chunk(0, nbdproto.ChunkOffsetData, c, u64(off+uint64(half)), bytes.Repeat([]byte{7}, int(n-half))))
				w.Write(chunk(done, nbdproto.ChunkOffsetHole, c, u64(off), u32(half)))
			},
			want: func(n int) []byte { return append(make([]byte, n/2), bytes.Repeat([]byte{7}, n-n/2)...) }},
		{name: "error-with-message", healthy: true, errMsg: "disk on fire",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				w.Write(chunk(done, nbdproto.ChunkError, c, u32(nbdproto.EIO), u16(12), []byte("disk on fire")))
			}},
		{name: "error-offset", healthy: true, errMsg: "bad block",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				w.Write(chunk(0, nbdproto.ChunkOffsetData, c, u64(off), make([]byte, n)))
				w.Write(chunk(done, nbdproto.ChunkErrorOffset, c, u32(nbdproto.EIO), u16(9), []byte("bad block"), u64(off)))
			}},
		{name: "not-covered", healthy: true, errMsg: "covered",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				w.Write(chunk(done, nbdproto.ChunkOffsetData, c, u64(off), make([]byte, n/2)))
			}},
		{name: "data-longer-than-request",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				w.Write(chunk(done, nbdproto.ChunkOffsetData, c, u64(off), make([]byte, n+1)))
			}},
		{name: "data-before-request",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				w.Write(chunk(done, nbdproto.ChunkOffsetData, c, u64(off-1), make([]byte, n)))
			}},
		{name: "hole-past-request",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				w.Write(chunk(done, nbdproto.ChunkOffsetHole, c, u64(off), u32(n+4096)))
			}},
		{name: "huge-error-chunk",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				// Claims 1 GiB: refused from the header, nothing allocated for it.
				h := chunk(done, nbdproto.ChunkError, c)
				binary.BigEndian.PutUint32(h[16:], 1<<30)
				w.Write(h)
			}},
		{name: "error-message-overruns",
			reply: func(w io.Writer, c, off uint64, n uint32) {
				w.Write(chunk(done, nbdproto.ChunkError, c, u32(nbdproto.EIO), u16(100), []byte("short")))
			}},
		{name: "none-with-payload",
			reply: func(w io.Writer, c, off uint64, n uint32) { w.Write(chunk(done, nbdproto.ChunkNone, c, u32(0))) }},
		{name: "unknown-cookie",
			reply: func(w io.Writer, c, off uint64, n uint32) { w.Write(chunk(done, nbdproto.ChunkNone, c+1000)) }},
		{name: "unknown-chunk-type",
			reply: func(w io.Writer, c, off uint64, n uint32) { w.Write(chunk(done, 77, c)) }},
		{name: "bad-magic",
			reply: func(w io.Writer, c, off uint64, n uint32) { w.Write(make([]byte, 20)) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := open(t, fakeServer(t, tc.reply), &Options{RequestTimeout: 500 * time.Millisecond, BackoffMax: 50 * time.Millisecond})
			got := make([]byte, 64<<10)
			_, err := r.ReadAt(got, 128<<10)
			if tc.want != nil {
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, tc.want(len(got))) {
					t.Fatal("read assembled the chunks wrongly")
				}
			} else {
				if !errors.Is(err, syscall.EIO) {
					t.Fatalf("read: %v, want EIO", err)
				}
				if tc.errMsg != "" && !bytes.Contains([]byte(err.Error()), []byte(tc.errMsg)) {
					t.Fatalf("read: %v, want the server's message %q", err, tc.errMsg)
				}
			}
			if tc.healthy && r.Reconnections() != 0 {
				t.Errorf("a well-formed reply cost %d reconnections", r.Reconnections())
			}
			if !tc.healthy && r.Reconnections() == 0 {
				t.Errorf("a malformed reply did not drop the connection")
			}
		})
	}
}

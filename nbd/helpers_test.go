package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// shortTempDir is a temporary directory with a short path: a unix socket path must fit
// in 108 bytes, and t.TempDir's grows with the test's name.
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "nbdt")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// testLogger sends server logs to the test log, so a failing test shows them.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(&tlogWriter{t: t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tlogWriter struct{ t testing.TB }

func (w *tlogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// serveUnix starts s on a fresh unix socket and returns its path. The server is shut down
// when the test ends; Shutdown's result is checked.
func serveUnix(t testing.TB, s *Server) string {
	t.Helper()
	if s.Logger == nil {
		s.Logger = testLogger(t)
	}
	path := filepath.Join(shortTempDir(t), "nbd.sock")
	l, err := ListenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-served; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve returned %v, want ErrServerClosed", err)
		}
	})
	return path
}

// serveTCP starts s, which must allow plain TCP, on a fresh loopback port and returns its
// address; the server is shut down when the test ends.
func serveTCP(t testing.TB, s *Server) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if s.Logger == nil {
		s.Logger = testLogger(t)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s.Shutdown(ctx)
		<-served
	})
	return l.Addr().String()
}

// rawClient speaks NBD byte by byte, for cases real clients never produce.
type rawClient struct {
	c          net.Conn
	structured bool
	readLens   map[uint64]uint32 // outstanding reads, for simple replies
}

func dialRaw(t testing.TB, path string) *rawClient {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(20 * time.Second))
	t.Cleanup(func() { c.Close() })
	return &rawClient{c: c, readLens: map[uint64]uint32{}}
}

func (rc *rawClient) write(b []byte) error {
	_, err := rc.c.Write(b)
	return err
}

// greet reads the server greeting and sends client flags.
func (rc *rawClient) greet(clientFlags uint32) (uint16, error) {
	var g [18]byte
	if _, err := io.ReadFull(rc.c, g[:]); err != nil {
		return 0, fmt.Errorf("read greeting: %w", err)
	}
	if binary.BigEndian.Uint64(g[0:]) != nbdproto.MagicNBD || binary.BigEndian.Uint64(g[8:]) != nbdproto.MagicOpt {
		return 0, fmt.Errorf("bad greeting % x", g)
	}
	var f [4]byte
	binary.BigEndian.PutUint32(f[:], clientFlags)
	return binary.BigEndian.Uint16(g[16:]), rc.write(f[:])
}

func optBytes(opt uint32, data []byte) []byte {
	b := make([]byte, 16, 16+len(data))
	binary.BigEndian.PutUint64(b, nbdproto.MagicOpt)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], uint32(len(data)))
	return append(b, data...)
}

func (rc *rawClient) sendOpt(opt uint32, data []byte) error { return rc.write(optBytes(opt, data)) }

type optReply struct {
	opt, typ uint32
	data     []byte
}

func (rc *rawClient) readOptReply() (optReply, error) {
	var h [20]byte
	if _, err := io.ReadFull(rc.c, h[:]); err != nil {
		return optReply{}, fmt.Errorf("read option reply: %w", err)
	}
	if m := binary.BigEndian.Uint64(h[0:]); m != nbdproto.MagicOptReply {
		return optReply{}, fmt.Errorf("bad option reply magic %#x", m)
	}
	r := optReply{opt: binary.BigEndian.Uint32(h[8:]), typ: binary.BigEndian.Uint32(h[12:])}
	n := binary.BigEndian.Uint32(h[16:])
	if n > 1<<20 {
		return r, fmt.Errorf("option reply of %d bytes", n)
	}
	r.data = make([]byte, n)
	_, err := io.ReadFull(rc.c, r.data)
	return r, err
}

// readOptReplies reads replies to one option up to and including its final one.
func (rc *rawClient) readOptReplies() ([]optReply, error) {
	var rs []optReply
	for {
		r, err := rc.readOptReply()
		if err != nil {
			return rs, err
		}
		rs = append(rs, r)
		if r.typ == nbdproto.RepAck || r.typ&nbdproto.RepFlagError != 0 {
			return rs, nil
		}
	}
}

func goData(name string, infos ...uint16) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(infos)))
	for _, i := range infos {
		b = binary.BigEndian.AppendUint16(b, i)
	}
	return b
}

type exportInfo struct {
	size              uint64
	flags             uint16
	minB, prefB, maxB uint32
	name, description string
}

func parseInfos(rs []optReply) (exportInfo, error) {
	var e exportInfo
	for _, r := range rs {
		if r.typ&nbdproto.RepFlagError != 0 {
			return e, fmt.Errorf("option error %#x: %s", r.typ, r.data)
		}
		if r.typ != nbdproto.RepInfo {
			continue
		}
		switch binary.BigEndian.Uint16(r.data) {
		case nbdproto.InfoExport:
			e.size = binary.BigEndian.Uint64(r.data[2:])
			e.flags = binary.BigEndian.Uint16(r.data[10:])
		case nbdproto.InfoBlockSize:
			e.minB = binary.BigEndian.Uint32(r.data[2:])
			e.prefB = binary.BigEndian.Uint32(r.data[6:])
			e.maxB = binary.BigEndian.Uint32(r.data[10:])
		case nbdproto.InfoName:
			e.name = string(r.data[2:])
		case nbdproto.InfoDescription:
			e.description = string(r.data[2:])
		}
	}
	return e, nil
}

// connect runs a whole handshake: optional structured replies, then NBD_OPT_GO.
func (rc *rawClient) connect(name string, structured bool) (exportInfo, error) {
	if _, err := rc.greet(nbdproto.FlagCFixedNewstyle | nbdproto.FlagCNoZeroes); err != nil {
		return exportInfo{}, err
	}
	if structured {
		if err := rc.sendOpt(nbdproto.OptStructuredReply, nil); err != nil {
			return exportInfo{}, err
		}
		r, err := rc.readOptReply()
		if err != nil || r.typ != nbdproto.RepAck {
			return exportInfo{}, fmt.Errorf("structured reply: %v %#x", err, r.typ)
		}
		rc.structured = true
	}
	if err := rc.sendOpt(nbdproto.OptGo, goData(name, nbdproto.InfoBlockSize)); err != nil {
		return exportInfo{}, err
	}
	rs, err := rc.readOptReplies()
	if err != nil {
		return exportInfo{}, err
	}
	return parseInfos(rs)
}

func mustConnect(t testing.TB, path string, structured bool) (*rawClient, exportInfo) {
	t.Helper()
	rc := dialRaw(t, path)
	info, err := rc.connect("", structured)
	if err != nil {
		t.Fatal(err)
	}
	return rc, info
}

func reqBytes(typ, flags uint16, handle, off uint64, length uint32, payload []byte) []byte {
	b := make([]byte, 28, 28+len(payload))
	binary.BigEndian.PutUint32(b[0:], nbdproto.MagicRequest)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], typ)
	binary.BigEndian.PutUint64(b[8:], handle)
	binary.BigEndian.PutUint64(b[16:], off)
	binary.BigEndian.PutUint32(b[24:], length)
	return append(b, payload...)
}

func (rc *rawClient) send(typ, flags uint16, handle, off uint64, length uint32, payload []byte) error {
	if typ == nbdproto.CmdRead {
		rc.readLens[handle] = length
	}
	return rc.write(reqBytes(typ, flags, handle, off, length, payload))
}

// reply is one whole reply: a simple reply, or every chunk of a structured one gathered.
type reply struct {
	handle  uint64
	err     uint32 // first error, 0 on success
	msg     string
	errOff  int64 // from NBD_REPLY_TYPE_ERROR_OFFSET, else -1
	data    []byte
	dataOff uint64
	chunks  int
	simple  bool
}

// readReply reads one reply; with structured replies, chunks up to the DONE flag (the
// server never interleaves, but the client does not rely on it for a single handle).
func (rc *rawClient) readReply() (reply, error) {
	var m [4]byte
	if _, err := io.ReadFull(rc.c, m[:]); err != nil {
		return reply{}, err
	}
	switch binary.BigEndian.Uint32(m[:]) {
	case nbdproto.MagicSimpleReply:
		var h [12]byte
		if _, err := io.ReadFull(rc.c, h[:]); err != nil {
			return reply{}, err
		}
		r := reply{simple: true, err: binary.BigEndian.Uint32(h[0:]), handle: binary.BigEndian.Uint64(h[4:]), errOff: -1}
		if n, isRead := rc.readLens[r.handle]; isRead {
			delete(rc.readLens, r.handle)
			if r.err == 0 {
				r.data = make([]byte, n)
				if _, err := io.ReadFull(rc.c, r.data); err != nil {
					return r, err
				}
			}
		}
		return r, nil
	case nbdproto.MagicStructuredReply:
		r := reply{errOff: -1}
		for {
			if r.chunks > 0 {
				if _, err := io.ReadFull(rc.c, m[:]); err != nil {
					return r, err
				}
				if got := binary.BigEndian.Uint32(m[:]); got != nbdproto.MagicStructuredReply {
					return r, fmt.Errorf("chunk %d: bad magic %#x", r.chunks, got)
				}
			}
			var h [16]byte
			if _, err := io.ReadFull(rc.c, h[:]); err != nil {
				return r, err
			}
			flags := binary.BigEndian.Uint16(h[0:])
			typ := binary.BigEndian.Uint16(h[2:])
			r.handle = binary.BigEndian.Uint64(h[4:])
			n := binary.BigEndian.Uint32(h[12:])
			if n > MaxRequest+8 {
				return r, fmt.Errorf("chunk of %d bytes", n)
			}
			p := make([]byte, n)
			if _, err := io.ReadFull(rc.c, p); err != nil {
				return r, err
			}
			r.chunks++
			switch typ {
			case nbdproto.ChunkNone:
				if n != 0 {
					return r, fmt.Errorf("NONE chunk with %d bytes", n)
				}
			case nbdproto.ChunkOffsetData:
				r.dataOff = binary.BigEndian.Uint64(p)
				r.data = append(r.data, p[8:]...)
			case nbdproto.ChunkError, nbdproto.ChunkErrorOffset:
				r.err = binary.BigEndian.Uint32(p)
				ml := int(binary.BigEndian.Uint16(p[4:]))
				if 6+ml > len(p) {
					return r, fmt.Errorf("error message length %d overflows chunk of %d", ml, n)
				}
				r.msg = string(p[6 : 6+ml])
				if typ == nbdproto.ChunkErrorOffset {
					r.errOff = int64(binary.BigEndian.Uint64(p[6+ml:]))
				}
			default:
				return r, fmt.Errorf("unexpected chunk type %d", typ)
			}
			if flags&nbdproto.ReplyFlagDone != 0 {
				delete(rc.readLens, r.handle)
				return r, nil
			}
		}
	default:
		return reply{}, fmt.Errorf("bad reply magic % x", m)
	}
}

// roundTrip sends one request and reads its reply.
func (rc *rawClient) roundTrip(t testing.TB, typ, flags uint16, off uint64, length uint32, payload []byte) reply {
	t.Helper()
	if err := rc.send(typ, flags, 77, off, length, payload); err != nil {
		t.Fatal(err)
	}
	r, err := rc.readReply()
	if err != nil {
		t.Fatalf("%s: %v", cmdName(typ), err)
	}
	if r.handle != 77 {
		t.Fatalf("reply handle %d, want 77", r.handle)
	}
	return r
}

// expectClosed checks that the server closes the connection without sending anything
// more than what is in allowed.
func (rc *rawClient) expectClosed(t testing.TB) {
	t.Helper()
	rest, err := io.ReadAll(rc.c)
	if err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset by peer") {
		t.Fatalf("waiting for close: %v (after % x)", err, rest)
	}
	if len(rest) != 0 {
		t.Fatalf("server sent % x before closing", rest)
	}
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*13+int(seed)) ^ byte(i>>8)
	}
	return b
}

func mustEqual(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("%s: differs at byte %d (got %d bytes, want %d)", what, i, len(got), len(want))
	}
}

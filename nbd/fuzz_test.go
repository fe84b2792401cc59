package nbd

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// Fuzz targets for the two places that parse client bytes: the handshake and the request
// loop. Each input is a client's whole byte stream, played to a connection of a real
// Server over an in-memory net.Conn. The oracles: no panic (the test backend also panics
// if the server lets an out-of-bounds request through), the connection always ends, every
// budget taken is given back, the server's output is a well-formed NBD stream, and the
// bytes allocated stay within what the requests could legitimately cost.

// fakeConn is a net.Conn whose client side is a fixed byte string.
type fakeConn struct {
	in     *bytes.Reader
	mu     sync.Mutex
	out    bytes.Buffer
	closed bool
}

type fakeAddr struct{}

func (fakeAddr) Network() string { return "fuzz" }
func (fakeAddr) String() string  { return "fuzz" }

func (c *fakeConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, net.ErrClosed
	}
	return c.in.Read(p)
}

func (c *fakeConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, net.ErrClosed
	}
	return c.out.Write(p)
}

func (c *fakeConn) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	return nil
}

func (c *fakeConn) LocalAddr() net.Addr              { return fakeAddr{} }
func (c *fakeConn) RemoteAddr() net.Addr             { return fakeAddr{} }
func (c *fakeConn) SetDeadline(time.Time) error      { return nil }
func (c *fakeConn) SetReadDeadline(time.Time) error  { return nil }
func (c *fakeConn) SetWriteDeadline(time.Time) error { return nil }

const fuzzExportSize = 1 << 20

func fuzzServer() *Server {
	s := &Server{Exports: []Export{
		{Name: "", Description: "fuzz", Backend: newMem(fuzzExportSize), MultiConn: true},
		{Name: "ro", Backend: newMem(fuzzExportSize), ReadOnly: true, MinBlock: 512, PreferredBlock: 4096, MaxBlock: 64 << 10},
	}}
	if err := s.init(); err != nil {
		panic(err)
	}
	return s
}

// play runs one connection over input and returns what the server wrote.
func play(t *testing.T, s *Server, input []byte) []byte {
	fc := &fakeConn{in: bytes.NewReader(input)}
	c := newConn(s, fc)
	s.mu.Lock()
	s.conns[c] = struct{}{}
	s.active.Add(1)
	s.mu.Unlock()

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.serve()
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("connection still running 20s after its input ended")
	}
	runtime.ReadMemStats(&after)

	// Every request's budget came back.
	for name, l := range map[string]*limiter{"connection": c.local, "server": s.global} {
		l.mu.Lock()
		slots, b, q := l.slots, l.bytes, len(l.queue)
		l.mu.Unlock()
		wantSlots, wantBytes := s.maxInFlight(), s.maxBytes()
		if name == "connection" {
			wantSlots, wantBytes = s.maxInFlightPerConn(), s.maxBytesPerConn()
		}
		if slots != wantSlots || b != wantBytes || q != 0 {
			t.Fatalf("%s budget not returned: slots %d/%d bytes %d/%d queue %d", name, slots, wantSlots, b, wantBytes, q)
		}
	}
	s.global.mu.Lock()
	if c.res.slots != reserveSlots || c.res.bytes != reserveBytes {
		t.Fatalf("reserve not returned: slots %d bytes %d", c.res.slots, c.res.bytes)
	}
	s.global.mu.Unlock()
	// No request may cost more than an export's size in buffers, the handshake at most its
	// option buffer and replies.
	requests := uint64(len(input)/nbdproto.RequestHeaderLen + 1)
	bound := 1<<20 + 64*uint64(len(input)) + requests*(fuzzExportSize+64<<10)
	if got := after.TotalAlloc - before.TotalAlloc; got > bound {
		t.Fatalf("serving %d input bytes allocated %d bytes, bound %d", len(input), got, bound)
	}
	fc.mu.Lock()
	defer fc.mu.Unlock()
	return fc.out.Bytes()
}

// checkHandshakeOutput checks the greeting and every option reply up to the point where
// the stream can no longer be read without context (transmission).
func checkHandshakeOutput(t *testing.T, out []byte) []byte {
	if len(out) < 18 {
		t.Fatalf("greeting is %d bytes", len(out))
	}
	if binary.BigEndian.Uint64(out) != nbdproto.MagicNBD || binary.BigEndian.Uint64(out[8:]) != nbdproto.MagicOpt ||
		binary.BigEndian.Uint16(out[16:]) != nbdproto.FlagFixedNewstyle|nbdproto.FlagNoZeroes {
		t.Fatalf("bad greeting % x", out[:18])
	}
	out = out[18:]
	for len(out) >= nbdproto.OptionReplyHeaderLen && binary.BigEndian.Uint64(out) == nbdproto.MagicOptReply {
		typ := binary.BigEndian.Uint32(out[12:])
		n := binary.BigEndian.Uint32(out[16:])
		if uint64(n) > uint64(len(out)-nbdproto.OptionReplyHeaderLen) {
			t.Fatalf("option reply claims %d bytes, %d follow", n, len(out)-nbdproto.OptionReplyHeaderLen)
		}
		data := out[nbdproto.OptionReplyHeaderLen : nbdproto.OptionReplyHeaderLen+n]
		switch typ {
		case nbdproto.RepAck:
			if n != 0 {
				t.Fatalf("ACK with %d bytes", n)
			}
		case nbdproto.RepMetaContext:
			if n < 4 || string(data[4:]) != nbdproto.MetaBaseAllocation {
				t.Fatalf("malformed NBD_REP_META_CONTEXT % x", data)
			}
		case nbdproto.RepServer:
			if n < 4 || binary.BigEndian.Uint32(data) > n-4 {
				t.Fatalf("malformed NBD_REP_SERVER % x", data)
			}
		case nbdproto.RepInfo:
			if n < 2 {
				t.Fatalf("short NBD_REP_INFO")
			}
			want := map[uint16]uint32{nbdproto.InfoExport: nbdproto.InfoExportPayloadLen, nbdproto.InfoBlockSize: nbdproto.InfoBlockPayloadLen}
			if w, ok := want[binary.BigEndian.Uint16(data)]; ok && n != w {
				t.Fatalf("info %d of %d bytes", binary.BigEndian.Uint16(data), n)
			}
		default:
			if typ&nbdproto.RepFlagError == 0 {
				t.Fatalf("unknown option reply type %#x", typ)
			}
			if n > maxErrorMessage {
				t.Fatalf("error message of %d bytes", n)
			}
		}
		out = out[nbdproto.OptionReplyHeaderLen+n:]
	}
	return out
}

// checkStructuredStream checks a transmission-phase stream after structured replies were
// negotiated, where it can be parsed without knowing the requests: simple replies carry no
// data, and every chunk is of a known type with a consistent length.
func checkStructuredStream(t *testing.T, out []byte, handles map[uint64]bool) {
	for len(out) > 0 {
		if len(out) < 4 {
			t.Fatalf("%d stray bytes", len(out))
		}
		switch binary.BigEndian.Uint32(out) {
		case nbdproto.MagicSimpleReply:
			if len(out) < nbdproto.SimpleReplyHeaderLen {
				t.Fatal("truncated simple reply")
			}
			if h := binary.BigEndian.Uint64(out[8:]); !handles[h] {
				t.Fatalf("reply to handle %d that no request carried", h)
			}
			out = out[nbdproto.SimpleReplyHeaderLen:]
		case nbdproto.MagicStructuredReply:
			if len(out) < nbdproto.StructuredHeaderLen {
				t.Fatal("truncated chunk header")
			}
			flags := binary.BigEndian.Uint16(out[4:])
			typ := binary.BigEndian.Uint16(out[6:])
			h := binary.BigEndian.Uint64(out[8:])
			n := binary.BigEndian.Uint32(out[16:])
			if !handles[h] {
				t.Fatalf("chunk for handle %d that no request carried", h)
			}
			if flags&^nbdproto.ReplyFlagDone != 0 || flags&nbdproto.ReplyFlagDone == 0 {
				t.Fatalf("chunk flags %#x: the server always sends one chunk, flagged DONE", flags)
			}
			if uint64(n) > uint64(len(out)-nbdproto.StructuredHeaderLen) {
				t.Fatalf("chunk claims %d bytes, %d follow", n, len(out)-nbdproto.StructuredHeaderLen)
			}
			p := out[nbdproto.StructuredHeaderLen : nbdproto.StructuredHeaderLen+n]
			switch typ {
			case nbdproto.ChunkNone:
				if n != 0 {
					t.Fatalf("NONE chunk of %d bytes", n)
				}
			case nbdproto.ChunkOffsetData:
				if n < 9 || n > 8+MaxRequest {
					t.Fatalf("data chunk of %d bytes", n)
				}
				if off := binary.BigEndian.Uint64(p); off+uint64(n-8) > fuzzExportSize {
					t.Fatalf("data chunk [%d, +%d) outside the export", off, n-8)
				}
			case nbdproto.ChunkBlockStatus:
				if n < 12 || (n-4)%8 != 0 || binary.BigEndian.Uint32(p) != baseAllocationID {
					t.Fatalf("malformed block status chunk % x", p)
				}
			case nbdproto.ChunkError, nbdproto.ChunkErrorOffset:
				min := uint32(6)
				if typ == nbdproto.ChunkErrorOffset {
					min = 14
				}
				if n < min || binary.BigEndian.Uint32(p) == 0 || uint32(binary.BigEndian.Uint16(p[4:])) != n-min {
					t.Fatalf("malformed error chunk % x", p)
				}
			default:
				t.Fatalf("unknown chunk type %d", typ)
			}
			out = out[nbdproto.StructuredHeaderLen+n:]
		default:
			t.Fatalf("bad reply magic % x", out[:4])
		}
	}
}

// checkExtendedStream checks a transmission-phase stream after extended headers were
// negotiated: every reply is an extended chunk, flagged DONE, of a known type with a
// consistent length.
func checkExtendedStream(t *testing.T, out []byte, handles map[uint64]bool) {
	for len(out) > 0 {
		if len(out) < nbdproto.ExtendedReplyLen {
			t.Fatalf("%d stray bytes", len(out))
		}
		if m := binary.BigEndian.Uint32(out); m != nbdproto.MagicExtendedReply {
			t.Fatalf("reply magic %#x with extended headers", m)
		}
		flags := binary.BigEndian.Uint16(out[4:])
		typ := binary.BigEndian.Uint16(out[6:])
		h := binary.BigEndian.Uint64(out[8:])
		n := binary.BigEndian.Uint64(out[24:])
		if !handles[h] {
			t.Fatalf("chunk for handle %d that no request carried", h)
		}
		if flags != nbdproto.ReplyFlagDone {
			t.Fatalf("chunk flags %#x", flags)
		}
		if n > uint64(len(out)-nbdproto.ExtendedReplyLen) {
			t.Fatalf("chunk claims %d bytes, %d follow", n, len(out)-nbdproto.ExtendedReplyLen)
		}
		p := out[nbdproto.ExtendedReplyLen : nbdproto.ExtendedReplyLen+n]
		switch typ {
		case nbdproto.ChunkNone:
			if n != 0 {
				t.Fatalf("NONE chunk of %d bytes", n)
			}
		case nbdproto.ChunkOffsetData:
			if n < 9 || n > 8+MaxRequest || binary.BigEndian.Uint64(p)+(n-8) > fuzzExportSize {
				t.Fatalf("bad data chunk of %d bytes", n)
			}
		case nbdproto.ChunkBlockStatusExt:
			if n < 24 || binary.BigEndian.Uint32(p) != baseAllocationID || uint64(binary.BigEndian.Uint32(p[4:]))*16+8 != n {
				t.Fatalf("malformed extended block status % x", p)
			}
		case nbdproto.ChunkError, nbdproto.ChunkErrorOffset:
			min := uint64(6)
			if typ == nbdproto.ChunkErrorOffset {
				min = 14
			}
			if n < min || binary.BigEndian.Uint32(p) == 0 || uint64(binary.BigEndian.Uint16(p[4:])) != n-min {
				t.Fatalf("malformed error chunk % x", p)
			}
		default:
			t.Fatalf("unknown chunk type %d", typ)
		}
		out = out[nbdproto.ExtendedReplyLen+n:]
	}
}

func FuzzHandshake(f *testing.F) {
	for _, s := range handshakeSeeds() {
		f.Add(s)
	}
	s := fuzzServer()
	f.Fuzz(func(t *testing.T, input []byte) {
		checkHandshakeOutput(t, play(t, s, input))
	})
}

// transmissionPrefix is the handshake a transmission input is played after: mode bit 0
// asks for structured replies, bit 1 picks the read-only export with 512-byte blocks, bit
// 2 asks for extended headers, bit 3 selects base:allocation.
func transmissionPrefix(mode byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, nbdproto.FlagCFixedNewstyle|nbdproto.FlagCNoZeroes)
	if mode&4 != 0 {
		b = append(b, optBytes(nbdproto.OptExtendedHeaders, nil)...)
	}
	if mode&1 != 0 {
		b = append(b, optBytes(nbdproto.OptStructuredReply, nil)...)
	}
	if mode&8 != 0 {
		name := ""
		if mode&2 != 0 {
			name = "ro"
		}
		b = append(b, optBytes(nbdproto.OptSetMetaContext, metaData(name, nbdproto.MetaBaseAllocation))...)
	}
	name := ""
	if mode&2 != 0 {
		name = "ro"
	}
	return append(b, optBytes(nbdproto.OptGo, goData(name, nbdproto.InfoBlockSize))...)
}

func FuzzTransmission(f *testing.F) {
	for _, s := range transmissionSeeds() {
		f.Add(s[0], s[1:])
	}
	s := fuzzServer()
	f.Fuzz(func(t *testing.T, mode byte, requests []byte) {
		input := append(transmissionPrefix(mode), requests...)
		out := checkHandshakeOutput(t, play(t, s, input))
		if mode&4 != 0 {
			handles := map[uint64]bool{}
			for i := 0; i+16 <= len(requests); i++ {
				handles[binary.BigEndian.Uint64(requests[i+8:])] = true
			}
			checkExtendedStream(t, out, handles)
			return
		}
		if mode&1 == 0 {
			return // simple replies cannot be parsed without the requests
		}
		// Handles the requests could carry: any 8 bytes at offset 8 of a 28-byte frame,
		// wherever frames start; collect every candidate to keep the check cheap and sound.
		handles := map[uint64]bool{}
		for i := 0; i+16 <= len(requests); i++ {
			handles[binary.BigEndian.Uint64(requests[i+8:])] = true
		}
		checkStructuredStream(t, out, handles)
	})
}

// Seeds: what well-behaved clients send, and the edge cases the tests single out.

func handshakeSeeds() [][]byte {
	flags := binary.BigEndian.AppendUint32(nil, nbdproto.FlagCFixedNewstyle|nbdproto.FlagCNoZeroes)
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	bad := optBytes(nbdproto.OptList, nil)
	bad[3] ^= 1
	return [][]byte{
		cat(flags, optBytes(nbdproto.OptStructuredReply, nil), optBytes(nbdproto.OptGo, goData("", nbdproto.InfoName, nbdproto.InfoDescription, nbdproto.InfoBlockSize))),
		cat(flags, optBytes(nbdproto.OptList, nil), optBytes(nbdproto.OptAbort, nil)),
		cat(flags, optBytes(nbdproto.OptInfo, goData("ro", nbdproto.InfoBlockSize)), optBytes(nbdproto.OptInfo, goData("nope")), optBytes(nbdproto.OptAbort, nil)),
		cat(flags, optBytes(nbdproto.OptExportName, []byte("ro"))),
		cat(binary.BigEndian.AppendUint32(nil, nbdproto.FlagCFixedNewstyle), optBytes(nbdproto.OptExportName, nil), reqBytes(nbdproto.CmdRead, 0, 1, 0, 512, nil)),
		cat(flags, optBytes(nbdproto.OptStartTLS, nil), optBytes(nbdproto.OptSetMetaContext, []byte{0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 15}), optBytes(999, []byte("x"))),
		cat(flags, optBytes(nbdproto.OptInfo, []byte{0, 0, 0, 9, 'a', 0, 1})),
		cat(flags, optBytes(nbdproto.OptStructuredReply, []byte{1})),
		cat(flags, optBytes(999, make([]byte, maxOptionData+1))),
		cat(flags, optBytes(999, nil)[:16]),
		cat(flags, bad),
		{0, 0, 0, 0},
		binary.BigEndian.AppendUint32(nil, 0xffffffff),
		cat(flags, optBytes(nbdproto.OptListMetaContext, metaData("", "base:")), optBytes(nbdproto.OptExtendedHeaders, nil),
			optBytes(nbdproto.OptStructuredReply, nil), optBytes(nbdproto.OptSetMetaContext, metaData("", nbdproto.MetaBaseAllocation)),
			optBytes(nbdproto.OptSetMetaContext, metaData("nope", "base:")), optBytes(nbdproto.OptAbort, nil)),
		cat([]byte{0, 0, 0, 0}, optBytes(nbdproto.OptExportName, []byte("ro"))),
		cat([]byte{0, 0, 0, 0}, optBytes(nbdproto.OptList, nil)),
	}
}

func transmissionSeeds() [][]byte {
	r := func(typ, flags uint16, h, off uint64, n uint32, p []byte) []byte {
		return reqBytes(typ, flags, h, off, n, p)
	}
	seq := func(mode byte, reqs ...[]byte) []byte { return append([]byte{mode}, bytes.Join(reqs, nil)...) }
	var seeds [][]byte
	for _, mode := range []byte{0, 1, 2, 3} {
		seeds = append(seeds,
			seq(mode,
				r(nbdproto.CmdWrite, nbdproto.CmdFlagFUA, 1, 4096, 512, pattern(512, 1)),
				r(nbdproto.CmdRead, 0, 2, 4096, 512, nil),
				r(nbdproto.CmdRead, nbdproto.CmdFlagDF, 3, 0, 4096, nil),
				r(nbdproto.CmdFlush, 0, 4, 0, 0, nil),
				r(nbdproto.CmdTrim, 0, 5, 0, 4096, nil),
				r(nbdproto.CmdWriteZeroes, nbdproto.CmdFlagNoHole|nbdproto.CmdFlagFastZero, 6, 8192, 4096, nil),
				r(nbdproto.CmdCache, 0, 7, 0, 65536, nil),
				r(nbdproto.CmdDisc, 0, 8, 0, 0, nil)),
			seq(mode,
				r(nbdproto.CmdRead, 0, 1, fuzzExportSize-100, 512, nil),
				r(nbdproto.CmdRead, 0, 2, 1<<63, 512, nil),
				r(nbdproto.CmdWrite, 0, 3, fuzzExportSize, 16, make([]byte, 16)),
				r(nbdproto.CmdRead, 0, 4, 0, MaxRequest+1, nil),
				r(nbdproto.CmdBlockStatus, nbdproto.CmdFlagReqOne, 5, 0, 512, nil),
				r(77, 0, 6, 0, 0, nil),
				r(nbdproto.CmdRead, 1<<15, 7, 0, 512, nil),
				r(nbdproto.CmdRead, 0, 8, 0, 0, nil),
				r(nbdproto.CmdWrite, 0, 9, 0, 33<<20, nil)),
			seq(mode, r(nbdproto.CmdWrite, 0, 1, 0, 1<<20, make([]byte, 1<<10))),
			seq(mode, []byte{0x25, 0x60, 0x95, 0x14}, make([]byte, 24)),
		)
	}
	x := func(typ, flags uint16, h, off, n uint64, p []byte) []byte {
		b := binary.BigEndian.AppendUint32(nil, nbdproto.MagicExtendedRequest)
		b = binary.BigEndian.AppendUint16(b, flags)
		b = binary.BigEndian.AppendUint16(b, typ)
		b = binary.BigEndian.AppendUint64(b, h)
		b = binary.BigEndian.AppendUint64(b, off)
		b = binary.BigEndian.AppendUint64(b, n)
		return append(b, p...)
	}
	for _, mode := range []byte{4 | 8, 4 | 8 | 2, 4} {
		seeds = append(seeds, seq(mode,
			x(nbdproto.CmdWrite, 0, 1, 4096, 512, pattern(512, 1)),
			x(nbdproto.CmdRead, 0, 2, 4096, 512, nil),
			x(nbdproto.CmdBlockStatus, 0, 3, 0, fuzzExportSize, nil),
			x(nbdproto.CmdBlockStatus, nbdproto.CmdFlagReqOne, 4, 512, 1<<40, nil),
			x(nbdproto.CmdFlush, nbdproto.CmdFlagPayloadLen, 5, 0, 8, make([]byte, 8)),
			x(nbdproto.CmdTrim, 0, 6, 0, 1<<33, nil),
			x(nbdproto.CmdRead, 0, 7, 0, MaxRequest+1, nil),
			x(nbdproto.CmdWrite, 0, 8, 0, 1<<62, nil)))
	}
	seeds = append(seeds, seq(1|8,
		r(nbdproto.CmdBlockStatus, 0, 1, 0, fuzzExportSize, nil),
		r(nbdproto.CmdBlockStatus, nbdproto.CmdFlagReqOne, 2, 4096, 512, nil)))
	return seeds
}

// TestFuzzSeedsUpToDate checks that testdata/fuzz holds exactly the seeds the functions
// above produce (the checked-in corpus runs with every `go test`); with
// NBD_WRITE_FUZZ_SEEDS=1 it rewrites them instead.
func TestFuzzSeedsUpToDate(t *testing.T) {
	regenerate := os.Getenv("NBD_WRITE_FUZZ_SEEDS") == "1"
	check := func(target string, i int, args ...any) {
		var b bytes.Buffer
		b.WriteString("go test fuzz v1\n")
		for _, a := range args {
			switch v := a.(type) {
			case byte:
				fmt.Fprintf(&b, "byte(%s)\n", strconv.QuoteRune(rune(v)))
			case []byte:
				fmt.Fprintf(&b, "[]byte(%s)\n", strconv.Quote(string(v)))
			}
		}
		dir := filepath.Join("testdata", "fuzz", target)
		path := filepath.Join(dir, fmt.Sprintf("seed%02d", i))
		if regenerate {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
		got, err := os.ReadFile(path)
		if err != nil || !bytes.Equal(got, b.Bytes()) {
			t.Errorf("%s is missing or stale (%v): regenerate with NBD_WRITE_FUZZ_SEEDS=1 go test ./nbd -run TestFuzzSeedsUpToDate", path, err)
		}
	}
	for i, s := range handshakeSeeds() {
		check("FuzzHandshake", i, s)
	}
	for i, s := range transmissionSeeds() {
		check("FuzzTransmission", i, s[0], s[1:])
	}
}

var _ io.Reader = (*fakeConn)(nil)

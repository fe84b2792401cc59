package nbd

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
	"github.com/elidisk/eli/internal/testtool"
)

// sparseBackend stores only the 4 KiB blocks written with data, as eli's authenticated
// modes know which sectors were never written; the rest reads as zeroes and is reported
// as hole and zero. It can be far larger than memory.
type sparseBackend struct {
	size      int64
	mu        sync.RWMutex
	blocks    map[int64][]byte // by block index
	readBytes atomic.Int64     // bytes ReadAt was asked for, holes included
}

const sparseBlock = 4096

func newSparse(size int64) *sparseBackend {
	return &sparseBackend{size: size, blocks: map[int64][]byte{}}
}

func (s *sparseBackend) Size() int64 { return s.size }

func (s *sparseBackend) ReadAt(p []byte, off int64) error {
	s.readBytes.Add(int64(len(p)))
	s.mu.RLock()
	defer s.mu.RUnlock()
	for len(p) > 0 {
		i, in := off/sparseBlock, off%sparseBlock
		n := min(int64(len(p)), sparseBlock-in)
		if b, ok := s.blocks[i]; ok {
			copy(p[:n], b[in:])
		} else {
			clear(p[:n])
		}
		p, off = p[n:], off+n
	}
	return nil
}

func (s *sparseBackend) WriteAt(p []byte, off int64, f Flags) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(p) > 0 {
		i, in := off/sparseBlock, off%sparseBlock
		n := min(int64(len(p)), sparseBlock-in)
		b, ok := s.blocks[i]
		if !ok {
			b = make([]byte, sparseBlock)
			s.blocks[i] = b
		}
		copy(b[in:], p[:n])
		p, off = p[n:], off+n
	}
	return nil
}

// punch drops the whole blocks inside [off, off+n) and zeroes the partial ones.
func (s *sparseBackend) punch(off, n int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for end := off + n; off < end; {
		i, in := off/sparseBlock, off%sparseBlock
		k := min(end-off, sparseBlock-in)
		if k == sparseBlock {
			delete(s.blocks, i)
		} else if b, ok := s.blocks[i]; ok {
			clear(b[in : in+k])
		}
		off += k
	}
}

func (s *sparseBackend) WriteZeroes(off, n int64, f Flags) error { s.punch(off, n); return nil }
func (s *sparseBackend) Trim(off, n int64, f Flags) error        { s.punch(off, n); return nil }
func (s *sparseBackend) Flush() error                            { return nil }

// BlockStatus reports runs of stored blocks as data and runs of absent ones as holes.
func (s *sparseBackend) BlockStatus(off, length int64) ([]Extent, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var ext []Extent
	for end := off + length; off < end; {
		i, in := off/sparseBlock, off%sparseBlock
		k := min(end-off, sparseBlock-in)
		_, data := s.blocks[i]
		if n := len(ext); n > 0 && ext[n-1].Hole == !data {
			ext[n-1].Length += k
		} else {
			ext = append(ext, Extent{Length: k, Hole: !data, Zero: !data})
		}
		if !data && k == sparseBlock {
			// Skip a long hole without walking it block by block.
			next := end
			for j := range s.blocks {
				if j > i && j*sparseBlock < next {
					next = j * sparseBlock
				}
			}
			ext[len(ext)-1].Length += next - off - k
			off = next
			continue
		}
		off += k
	}
	return ext, nil
}

// sparseLayout writes data at [1, 2) MiB and [5, 5.5) MiB of an 8 MiB export.
func sparseLayout(t *testing.T) *sparseBackend {
	b := newSparse(8 << 20)
	if err := b.WriteAt(pattern(1<<20, 1), 1<<20, 0); err != nil {
		t.Fatal(err)
	}
	if err := b.WriteAt(pattern(512<<10, 2), 5<<20, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// wantMap is sparseLayout's map: offset, length, hole.
var wantMap = []struct {
	off, n int64
	hole   bool
}{
	{0, 1 << 20, true}, {1 << 20, 1 << 20, false}, {2 << 20, 3 << 20, true},
	{5 << 20, 512 << 10, false}, {5<<20 + 512<<10, 3<<20 - 512<<10, true},
}

func TestNbdinfoMap(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	path := serveUnix(t, oneExportServer(sparseLayout(t), nil))
	out := run(t, 30*time.Second, "nbdinfo", "--map", "--json", uriFor(path, ""))
	var got []struct {
		Offset, Length int64
		Type           uint32
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("nbdinfo --map --json: %v\n%s", err, out)
	}
	if len(got) != len(wantMap) {
		t.Fatalf("map %+v, want %+v", got, wantMap)
	}
	for i, w := range wantMap {
		typ := uint32(0)
		if w.hole {
			typ = nbdproto.StateHole | nbdproto.StateZero
		}
		if got[i].Offset != w.off || got[i].Length != w.n || got[i].Type != typ {
			t.Errorf("extent %d: %+v, want %+v", i, got[i], w)
		}
	}
}

func TestQemuImgMap(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "qemu-img", "qemu-utils")
	path := serveUnix(t, oneExportServer(sparseLayout(t), nil))
	out := run(t, 30*time.Second, "qemu-img", "map", "--output=json", "-f", "raw", uriFor(path, ""))
	var got []struct {
		Start, Length int64
		Data, Zero    bool
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("qemu-img map: %v\n%s", err, out)
	}
	if len(got) != len(wantMap) {
		t.Fatalf("map %+v, want %+v", got, wantMap)
	}
	for i, w := range wantMap {
		if got[i].Start != w.off || got[i].Length != w.n || got[i].Data == w.hole || got[i].Zero != w.hole {
			t.Errorf("extent %d: %+v, want %+v", i, got[i], w)
		}
	}
}

// TestNbdcopySkipsHoles: nbdcopy copies an export with holes correctly and reads only
// its data from the backend.
func TestNbdcopySkipsHoles(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	b := sparseLayout(t)
	path := serveUnix(t, oneExportServer(b, nil))
	dst := filepath.Join(t.TempDir(), "out.raw")
	run(t, time.Minute, "nbdcopy", uriFor(path, ""), dst)
	got, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 8<<20)
	if err := b.ReadAt(want, 0); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "copy", got, want)
	// 1.5 MiB of data, read once by nbdcopy and once above.
	if r := b.readBytes.Load() - 8<<20; r > 2<<20 {
		t.Errorf("nbdcopy read %d bytes of an export with 1.5 MiB of data: holes were not skipped", r)
	}
}

// --- raw protocol: BLOCK_STATUS details and extended headers ---

// extClient speaks extended headers (proto.md "Extended headers").
type extClient struct{ *rawClient }

func (ec extClient) send(typ, flags uint16, handle, off, length uint64, payload []byte) error {
	b := make([]byte, 32, 32+len(payload))
	binary.BigEndian.PutUint32(b[0:], nbdproto.MagicExtendedRequest)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], typ)
	binary.BigEndian.PutUint64(b[8:], handle)
	binary.BigEndian.PutUint64(b[16:], off)
	binary.BigEndian.PutUint64(b[24:], length)
	return ec.write(append(b, payload...))
}

type extChunk struct {
	flags, typ     uint16
	handle, off    uint64
	payload        []byte
	errCode        uint32
	ctxID          uint32
	extents        [][2]uint64 // length, flags
	data           []byte
	dataOff        uint64
	simpleOrCompat bool
}

// readChunk reads one reply chunk; with extended headers every reply must be one.
func (ec extClient) readChunk() (extChunk, error) {
	var h [32]byte
	if _, err := io.ReadFull(ec.c, h[:]); err != nil {
		return extChunk{}, err
	}
	if m := binary.BigEndian.Uint32(h[:]); m != nbdproto.MagicExtendedReply {
		return extChunk{simpleOrCompat: true}, fmt.Errorf("reply magic %#x, want the extended reply magic", m)
	}
	c := extChunk{
		flags: binary.BigEndian.Uint16(h[4:]), typ: binary.BigEndian.Uint16(h[6:]),
		handle: binary.BigEndian.Uint64(h[8:]), off: binary.BigEndian.Uint64(h[16:]),
	}
	n := binary.BigEndian.Uint64(h[24:])
	if n > MaxRequest+64 {
		return c, fmt.Errorf("chunk of %d bytes", n)
	}
	c.payload = make([]byte, n)
	if _, err := io.ReadFull(ec.c, c.payload); err != nil {
		return c, err
	}
	p := c.payload
	switch c.typ {
	case nbdproto.ChunkError, nbdproto.ChunkErrorOffset:
		c.errCode = binary.BigEndian.Uint32(p)
	case nbdproto.ChunkOffsetData:
		c.dataOff, c.data = binary.BigEndian.Uint64(p), p[8:]
	case nbdproto.ChunkBlockStatusExt:
		c.ctxID = binary.BigEndian.Uint32(p)
		count := binary.BigEndian.Uint32(p[4:])
		if uint64(len(p)) != 8+16*uint64(count) {
			return c, fmt.Errorf("BLOCK_STATUS_EXT of %d bytes with %d extents", len(p), count)
		}
		for i := range int(count) {
			e := p[8+16*i:]
			c.extents = append(c.extents, [2]uint64{binary.BigEndian.Uint64(e), binary.BigEndian.Uint64(e[8:])})
		}
	case nbdproto.ChunkNone:
	default:
		return c, fmt.Errorf("unexpected chunk type %d", c.typ)
	}
	return c, nil
}

func (ec extClient) roundTrip(t *testing.T, typ, flags uint16, off, length uint64, payload []byte) extChunk {
	t.Helper()
	if err := ec.send(typ, flags, 9, off, length, payload); err != nil {
		t.Fatal(err)
	}
	c, err := ec.readChunk()
	if err != nil {
		t.Fatalf("%s: %v", cmdName(typ), err)
	}
	if c.handle != 9 || c.flags != nbdproto.ReplyFlagDone {
		t.Fatalf("%s: chunk handle %d flags %#x", cmdName(typ), c.handle, c.flags)
	}
	return c
}

// connectExt negotiates extended headers and base:allocation, then GO.
func connectExt(t *testing.T, path string) extClient {
	t.Helper()
	rc := dialRaw(t, path)
	if _, err := rc.greet(nbdproto.FlagCFixedNewstyle | nbdproto.FlagCNoZeroes); err != nil {
		t.Fatal(err)
	}
	for _, o := range []struct {
		opt  uint32
		data []byte
		want []uint32
	}{
		{nbdproto.OptExtendedHeaders, nil, []uint32{nbdproto.RepAck}},
		{nbdproto.OptStructuredReply, nil, []uint32{nbdproto.RepErrExtHeaderReqd}},
		{nbdproto.OptSetMetaContext, metaData("", "base:allocation"), []uint32{nbdproto.RepMetaContext, nbdproto.RepAck}},
	} {
		rc.sendOpt(o.opt, o.data)
		rs, err := rc.readOptReplies()
		if err != nil || len(rs) != len(o.want) {
			t.Fatalf("option %d: %+v %v", o.opt, rs, err)
		}
		for i := range rs {
			if rs[i].typ != o.want[i] {
				t.Fatalf("option %d: reply %#x, want %#x", o.opt, rs[i].typ, o.want[i])
			}
		}
		if o.opt == nbdproto.OptSetMetaContext && (binary.BigEndian.Uint32(rs[0].data) != baseAllocationID || string(rs[0].data[4:]) != nbdproto.MetaBaseAllocation) {
			t.Fatalf("meta context reply % x", rs[0].data)
		}
	}
	rc.sendOpt(nbdproto.OptGo, goData(""))
	if _, err := rc.readOptReplies(); err != nil {
		t.Fatal(err)
	}
	return extClient{rc}
}

// TestExtendedHeaders: 32-byte requests and replies, every reply a chunk, 64-bit lengths
// on TRIM, WRITE_ZEROES and BLOCK_STATUS (extents longer than 4 GiB in
// NBD_REPLY_TYPE_BLOCK_STATUS_EXT), and the payload length flag.
func TestExtendedHeaders(t *testing.T) {
	t.Parallel()
	const size = 16 << 30
	b := newSparse(size)
	path := serveUnix(t, oneExportServer(b, nil))
	ec := connectExt(t, path)

	data := pattern(8192, 5)
	if c := ec.roundTrip(t, nbdproto.CmdWrite, nbdproto.CmdFlagPayloadLen, 6<<30, 8192, data); c.typ != nbdproto.ChunkNone {
		t.Fatalf("write: chunk type %d (error %d)", c.typ, c.errCode)
	}
	c := ec.roundTrip(t, nbdproto.CmdRead, 0, 6<<30, 8192, nil)
	if c.typ != nbdproto.ChunkOffsetData || c.dataOff != 6<<30 || c.off != 6<<30 {
		t.Fatalf("read: %+v", c)
	}
	mustEqual(t, "read", c.data, data)

	// One request for the whole 16 GiB: a 6 GiB hole, 8 KiB of data, the rest a hole.
	c = ec.roundTrip(t, nbdproto.CmdBlockStatus, 0, 0, size, nil)
	want := [][2]uint64{{6 << 30, 3}, {8192, 0}, {size - 6<<30 - 8192, 3}}
	if c.typ != nbdproto.ChunkBlockStatusExt || c.ctxID != baseAllocationID || fmt.Sprint(c.extents) != fmt.Sprint(want) {
		t.Fatalf("block status: type %d ctx %d extents %v, want %v", c.typ, c.ctxID, c.extents, want)
	}
	// REQ_ONE: just the first extent.
	c = ec.roundTrip(t, nbdproto.CmdBlockStatus, nbdproto.CmdFlagReqOne, 6<<30, 1<<30, nil)
	if fmt.Sprint(c.extents) != fmt.Sprint([][2]uint64{{8192, 0}}) {
		t.Fatalf("REQ_ONE: %v", c.extents)
	}
	// A 64-bit TRIM punches the data: all one hole.
	if c := ec.roundTrip(t, nbdproto.CmdTrim, 0, 4<<30, 8<<30, nil); c.typ != nbdproto.ChunkNone {
		t.Fatalf("trim: chunk type %d error %d", c.typ, c.errCode)
	}
	c = ec.roundTrip(t, nbdproto.CmdBlockStatus, 0, 0, size, nil)
	if fmt.Sprint(c.extents) != fmt.Sprint([][2]uint64{{size, 3}}) {
		t.Fatalf("after trim: %v", c.extents)
	}
	// Errors are chunks too, and the stream goes on.
	for _, e := range []struct {
		name        string
		typ, flags  uint16
		off, length uint64
		payload     []byte
		want        uint32
	}{
		{"read above the maximum", nbdproto.CmdRead, 0, 0, MaxRequest + 4096, nil, nbdproto.EInval},
		{"block status past the end", nbdproto.CmdBlockStatus, 0, size - 4096, 8192, nil, nbdproto.EInval},
		{"block status of nothing", nbdproto.CmdBlockStatus, 0, 0, 0, nil, nbdproto.EInval},
		{"payload on a flush", nbdproto.CmdFlush, nbdproto.CmdFlagPayloadLen, 0, 16, make([]byte, 16), nbdproto.EInval},
		{"write zeroes past the end", nbdproto.CmdWriteZeroes, 0, size - 4096, 1 << 40, nil, nbdproto.ENoSpc},
	} {
		c := ec.roundTrip(t, e.typ, e.flags, e.off, e.length, e.payload)
		if c.typ != nbdproto.ChunkError || c.errCode != e.want {
			t.Errorf("%s: chunk type %d error %d, want error %d", e.name, c.typ, c.errCode, e.want)
		}
	}
	if c := ec.roundTrip(t, nbdproto.CmdWrite, nbdproto.CmdFlagPayloadLen, 0, 4096, pattern(4096, 1)); c.typ != nbdproto.ChunkNone {
		t.Fatalf("write with the payload length flag: type %d error %d", c.typ, c.errCode)
	}
	// A compact request on an extended connection breaks the protocol (the server reads
	// 32 bytes, so send 4 more).
	ec.write(append(reqBytes(nbdproto.CmdRead, 0, 1, 0, 512, nil), 0, 0, 0, 0))
	ec.expectClosed(t)
}

// TestBlockStatusCompact: structured replies without extended headers get
// NBD_REPLY_TYPE_BLOCK_STATUS with 32-bit fields; a backend without BlockStatuser reports
// everything as data; BLOCK_STATUS without a selected context, or with a context chosen
// for another export, is EINVAL.
func TestBlockStatusCompact(t *testing.T) {
	t.Parallel()
	srv := &Server{Exports: []Export{
		{Name: "", Backend: sparseLayout(t)},
		{Name: "plain", Backend: newMem(1 << 20)},
	}}
	path := serveUnix(t, srv)
	connect := func(setFor, goTo string) *rawClient {
		rc := dialRaw(t, path)
		rc.greet(nbdproto.FlagCFixedNewstyle | nbdproto.FlagCNoZeroes)
		rc.sendOpt(nbdproto.OptStructuredReply, nil)
		rc.readOptReplies()
		rc.structured = true
		if setFor != "-" {
			rc.sendOpt(nbdproto.OptSetMetaContext, metaData(setFor, nbdproto.MetaBaseAllocation))
			if rs, err := rc.readOptReplies(); err != nil || len(rs) != 2 {
				t.Fatalf("SET_META_CONTEXT: %+v %v", rs, err)
			}
		}
		rc.sendOpt(nbdproto.OptGo, goData(goTo))
		if _, err := rc.readOptReplies(); err != nil {
			t.Fatal(err)
		}
		return rc
	}
	status := func(rc *rawClient, off uint64, n uint32) (uint32, [][2]uint32) {
		rc.send(nbdproto.CmdBlockStatus, 0, 3, off, n, nil)
		var h [20]byte
		if _, err := io.ReadFull(rc.c, h[:]); err != nil {
			t.Fatal(err)
		}
		p := make([]byte, binary.BigEndian.Uint32(h[16:]))
		if _, err := io.ReadFull(rc.c, p); err != nil {
			t.Fatal(err)
		}
		switch typ := binary.BigEndian.Uint16(h[6:]); typ {
		case nbdproto.ChunkError:
			return binary.BigEndian.Uint32(p), nil
		case nbdproto.ChunkBlockStatus:
			if binary.BigEndian.Uint32(p) != baseAllocationID || (len(p)-4)%8 != 0 {
				t.Fatalf("block status chunk % x", p)
			}
			var ext [][2]uint32
			for q := p[4:]; len(q) > 0; q = q[8:] {
				ext = append(ext, [2]uint32{binary.BigEndian.Uint32(q), binary.BigEndian.Uint32(q[4:])})
			}
			return 0, ext
		default:
			t.Fatalf("chunk type %d", typ)
		}
		return 0, nil
	}
	rc := connect("", "")
	if code, ext := status(rc, 512<<10, 1<<20); code != 0 || fmt.Sprint(ext) != fmt.Sprint([][2]uint32{{512 << 10, 3}, {512 << 10, 0}}) {
		t.Errorf("compact block status: %d %v", code, ext)
	}
	if code, ext := status(connect("plain", "plain"), 4096, 8192); code != 0 || fmt.Sprint(ext) != fmt.Sprint([][2]uint32{{8192, 0}}) {
		t.Errorf("backend without BlockStatuser: %d %v", code, ext)
	}
	if code, _ := status(connect("-", ""), 0, 4096); code != nbdproto.EInval {
		t.Errorf("without a context: error %d", code)
	}
	if code, _ := status(connect("plain", ""), 0, 4096); code != nbdproto.EInval {
		t.Errorf("context chosen for another export: error %d", code)
	}
}

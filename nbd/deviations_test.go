package nbd

import (
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// Spec deviations found by raw probes (issue 42 item 3), each against proto.md.

// TestExtendedWriteNeedsPayloadLen: with extended headers, NBD_CMD_WRITE MUST set
// NBD_CMD_FLAG_PAYLOAD_LEN, and without the flag no payload follows the header (its
// length is an effect length). The server answers EINVAL and reads the next request right
// after the header, rather than taking the next request's bytes for a payload.
func TestExtendedWriteNeedsPayloadLen(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	ec := connectExt(t, serveUnix(t, oneExportServer(mem, nil)))
	ec.c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := ec.send(nbdproto.CmdWrite, 0, 1, 0, 4096, nil); err != nil {
		t.Fatal(err)
	}
	if err := ec.send(nbdproto.CmdRead, 0, 2, 0, 4096, nil); err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct {
		handle uint64
		typ    uint16
		err    uint32
	}{{1, nbdproto.ChunkError, nbdproto.EInval}, {2, nbdproto.ChunkOffsetData, 0}} {
		c, err := ec.readChunk()
		if err != nil {
			t.Fatalf("reply %d: %v", want.handle, err)
		}
		if c.handle != want.handle || c.typ != want.typ || c.errCode != want.err {
			t.Fatalf("reply: handle %d type %d error %d, want handle %d type %d error %d", c.handle, c.typ, c.errCode, want.handle, want.typ, want.err)
		}
	}
	if ops := mem.opsCopy(); len(ops) != 0 {
		t.Fatalf("the write without its flag reached the backend: %+v", ops)
	}
}

// TestExtendedPayloadOverMaximum: an extended-header request whose PAYLOAD_LEN exceeds the
// maximum block size ends the connection at once (proto.md: the server SHOULD initiate a
// hard disconnect) instead of reading the payload; here only its first 4 KiB ever come.
func TestExtendedPayloadOverMaximum(t *testing.T) {
	t.Parallel()
	mem := newMem(4 << 20)
	ec := connectExt(t, serveUnix(t, oneExportServer(mem, func(e *Export) { e.MaxBlock = 1 << 20 })))
	ec.c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := ec.send(nbdproto.CmdWrite, nbdproto.CmdFlagPayloadLen, 1, 0, 2<<20, make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	ec.expectClosed(t)
	if ops := mem.opsCopy(); len(ops) != 0 {
		t.Fatalf("the backend saw %+v", ops)
	}
}

// TestFastZeroNeedsAlignment: NBD_CMD_FLAG_FAST_ZERO on a range not aligned to the
// preferred block size, which proto.md defines as the size below which I/O needs a
// read-modify-write, fails with ENOTSUP at once and leaves the export alone; an aligned
// one goes to the backend.
func TestFastZeroNeedsAlignment(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	rc, _ := mustConnect(t, serveUnix(t, oneExportServer(mem, func(e *Export) { e.PreferredBlock = 4096 })), true)
	for _, z := range [][2]uint32{{512, 4096}, {0, 6144}, {4096, 512}} {
		if r := rc.roundTrip(t, nbdproto.CmdWriteZeroes, nbdproto.CmdFlagFastZero, uint64(z[0]), z[1], nil); r.err != nbdproto.ENotSup {
			t.Errorf("fast zero of %d bytes at %d: error %d, want ENOTSUP", z[1], z[0], r.err)
		}
	}
	if ops := mem.opsCopy(); len(ops) != 0 {
		t.Fatalf("a refused fast zero reached the backend: %+v", ops)
	}
	if r := rc.roundTrip(t, nbdproto.CmdWriteZeroes, nbdproto.CmdFlagFastZero, 8192, 8192, nil); r.err != 0 {
		t.Fatalf("aligned fast zero: error %d %s", r.err, r.msg)
	}
}

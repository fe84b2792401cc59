package nbdclient

import (
	"io"
	"net"
	"testing"

	"github.com/elidisk/eli/internal/nbdproto"
)

// FuzzReplies feeds arbitrary bytes to a connection's reply reader as the server's
// answer to one read and one write in flight: whatever they say, the reader must neither
// panic nor write outside the read's buffer, and it answers each request at most once.
func FuzzReplies(f *testing.F) {
	const done = nbdproto.ReplyFlagDone
	// Cookies are 1 (the read of 4096 bytes at 8192) and 2 (the write).
	f.Add(append(chunk(0, nbdproto.ChunkOffsetData, 1, u64(8192), make([]byte, 2048)),
		chunk(done, nbdproto.ChunkOffsetHole, 1, u64(8192+2048), u32(2048))...))
	f.Add(chunk(done, nbdproto.ChunkError, 2, u32(nbdproto.EIO), u16(3), []byte("bad")))
	f.Add(chunk(done, nbdproto.ChunkErrorOffset, 1, u32(nbdproto.EIO), u16(0), u64(8192)))
	f.Add(chunk(done, nbdproto.ChunkOffsetData, 1, u64(8191), make([]byte, 4097)))
	f.Add(append(u32(nbdproto.MagicSimpleReply), append(u32(0), u64(2)...)...))
	f.Fuzz(func(t *testing.T, stream []byte) {
		client, server := net.Pipe()
		defer client.Close()
		answered := map[*op]int{}
		replies := make(chan struct{}, 4)
		c := newPconn(negotiated{conn: client, structured: true}, 1, 0,
			func(o *op, err error) { answered[o]++; replies <- struct{}{} }, nil)
		guard := make([]byte, 3*4096)
		read := &op{cmd: nbdproto.CmdRead, off: 8192, length: 4096, buf: guard[4096:8192]}
		write := &op{cmd: nbdproto.CmdWrite, off: 0, length: 512, data: make([]byte, 512)}
		go func() {
			io.CopyN(io.Discard, server, 2*nbdproto.RequestHeaderLen+512)
			server.Write(stream)
			server.Close()
		}()
		c.send(read)
		c.send(write)
		<-c.readerDone
		for i, b := range guard {
			if (i < 4096 || i >= 8192) && b != 0 {
				t.Fatalf("reply wrote outside the read's buffer at %d", i-4096)
			}
		}
		for o, n := range answered {
			if n > 1 {
				t.Fatalf("%s answered %d times", opName(o.cmd), n)
			}
		}
	})
}

package nbd

import (
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// BenchmarkReadUnderAttack measures what issue 42 measured with qemu-io -c 'read 0 4M': a
// fresh client's connect and one 4 MiB READ, on a server with the default limits, while
// raw clients stall in the middle of WRITE payloads of 1 to 64 MiB (as many as fill the
// shared pool, up to 60, each reconnecting when dropped), or while 16 idle TCP connections
// from the client's own address sit in the handshake ("none": no attack, for reference).
// ms/read is the latency of one read. The reconnected case first waits for the stallers'
// IOTimeout, half a minute; under the admission before issue 42, one read there and with
// 32 or 64 MiB stallers took a minute or more, so run those with -benchtime=1x.
func BenchmarkReadUnderAttack(b *testing.B) {
	b.Run("none", func(b *testing.B) {
		path := serveUnix(b, oneExportServer(newMem(64<<20), nil))
		readLatency(b, func() *rawClient { return dialRaw(b, path) })
	})
	for _, size := range []uint32{1 << 20, 2 << 20, 4 << 20, 32 << 20, 64 << 20} {
		b.Run(fmt.Sprintf("stallers-%dMiB", size>>20), func(b *testing.B) {
			srv := oneExportServer(newMem(64<<20), nil)
			path := serveUnix(b, srv)
			n := min(60, int(srv.maxBytes()/int64(size))+2)
			stop, stalls := stallingWriters(b, path, n, size)
			defer stop()
			for stalls.Load() < int64(n) {
				time.Sleep(5 * time.Millisecond)
			}
			readLatency(b, func() *rawClient { return dialRaw(b, path) })
		})
	}
	// Eight 32 MiB stallers, as in the issue, read only after they were dropped once
	// (their IOTimeout of 30 s passed) and came back.
	b.Run("reconnected-stallers-32MiB", func(b *testing.B) {
		srv := oneExportServer(newMem(64<<20), nil)
		path := serveUnix(b, srv)
		const n = 8
		stop, stalls := stallingWriters(b, path, n, 32<<20)
		defer stop()
		for stalls.Load() < 2*n {
			time.Sleep(5 * time.Millisecond)
		}
		readLatency(b, func() *rawClient { return dialRaw(b, path) })
	})
	b.Run("idle-handshakes", func(b *testing.B) {
		srv := oneExportServer(newMem(64<<20), nil)
		srv.AllowInsecureTCP = true
		addr := serveTCP(b, srv)
		idleTCP(b, addr, DefaultMaxConnsPerSource)
		readLatency(b, func() *rawClient {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				b.Fatal(err)
			}
			return &rawClient{c: c, readLens: map[uint64]uint32{}}
		})
	})
}

// readLatency times b.N rounds of: dial, handshake, one 4 MiB READ, close.
func readLatency(b *testing.B, dial func() *rawClient) {
	b.Helper()
	var total time.Duration
	for b.Loop() {
		start := time.Now()
		rc := dial()
		rc.c.SetDeadline(time.Now().Add(5 * time.Minute))
		if _, err := rc.connect("", true); err != nil {
			b.Fatalf("handshake: %v", err)
		}
		if err := rc.send(nbdproto.CmdRead, 0, 1, 0, 4<<20, nil); err != nil {
			b.Fatal(err)
		}
		if r, err := rc.readReply(); err != nil || r.err != 0 || len(r.data) != 4<<20 {
			b.Fatalf("read: %v %+v", err, r.err)
		}
		total += time.Since(start)
		rc.c.Close()
	}
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/read")
}

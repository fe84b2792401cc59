package nbd

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

func TestReadWriteRoundTrip(t *testing.T) {
	t.Parallel()
	mem := newMem(4 << 20)
	path := serveUnix(t, oneExportServer(mem, nil))
	for _, structured := range []bool{false, true} {
		for _, size := range []int{1, 512, 4096, 65536, 1 << 20, 4 << 20} {
			t.Run(fmt.Sprintf("structured=%v/%d", structured, size), func(t *testing.T) {
				rc, _ := mustConnect(t, path, structured)
				off := uint64((4<<20 - size) / 3)
				data := pattern(size, byte(size))
				if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, off, uint32(size), data); r.err != 0 {
					t.Fatalf("write: error %d %q", r.err, r.msg)
				}
				r := rc.roundTrip(t, nbdproto.CmdRead, 0, off, uint32(size), nil)
				if r.err != 0 {
					t.Fatalf("read: error %d %q", r.err, r.msg)
				}
				if structured && (r.simple || r.chunks != 1 || r.dataOff != off) {
					t.Fatalf("structured read: simple=%v chunks=%d offset=%d", r.simple, r.chunks, r.dataOff)
				}
				mustEqual(t, "read back", r.data, data)
				mustEqual(t, "backend", mem.snapshot()[off:off+uint64(size)], data)
			})
		}
	}
}

// TestRequestErrors: every case gets an error reply with the right code and the
// connection goes on (a read afterwards works).
func TestRequestErrors(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	srv := &Server{Exports: []Export{
		{Name: "", Backend: mem},
		{Name: "ro", Backend: newMem(1 << 20), ReadOnly: true},
		{Name: "aligned", Backend: newMem(1 << 20), MinBlock: 512, PreferredBlock: 4096, MaxBlock: 64 << 10},
	}}
	path := serveUnix(t, srv)
	const size = 1 << 20
	tests := []struct {
		name    string
		export  string
		typ     uint16
		flags   uint16
		off     uint64
		length  uint32
		payload bool
		want    uint32
	}{
		{"read past end", "", nbdproto.CmdRead, 0, size - 512, 1024, false, nbdproto.EInval},
		{"read starting past end", "", nbdproto.CmdRead, 0, size + 4096, 512, false, nbdproto.EInval},
		{"read offset overflow", "", nbdproto.CmdRead, 0, math.MaxUint64 - 100, 512, false, nbdproto.EInval},
		{"read longer than 32 MiB", "", nbdproto.CmdRead, 0, 0, MaxRequest + 1, false, nbdproto.EInval},
		{"write past end", "", nbdproto.CmdWrite, 0, size - 512, 1024, true, nbdproto.ENoSpc},
		{"write offset overflow", "", nbdproto.CmdWrite, 0, math.MaxUint64 - 100, 512, true, nbdproto.ENoSpc},
		{"write zeroes past end", "", nbdproto.CmdWriteZeroes, 0, size, 4096, false, nbdproto.ENoSpc},
		{"trim past end", "", nbdproto.CmdTrim, 0, size - 4096, 8192, false, nbdproto.EInval},
		{"cache past end", "", nbdproto.CmdCache, 0, size - 4096, 8192, false, nbdproto.EInval},
		{"unknown command", "", 42, 0, 0, 512, false, nbdproto.EInval},
		{"block status without context", "", nbdproto.CmdBlockStatus, 0, 0, 512, false, nbdproto.EInval},
		{"unknown flag", "", nbdproto.CmdRead, 1 << 9, 0, 512, false, nbdproto.EInval},
		{"no-hole on write", "", nbdproto.CmdWrite, nbdproto.CmdFlagNoHole, 0, 512, true, nbdproto.EInval},
		{"fast-zero on trim", "", nbdproto.CmdTrim, nbdproto.CmdFlagFastZero, 0, 512, false, nbdproto.EInval},
		{"flush with length", "", nbdproto.CmdFlush, 0, 0, 512, false, nbdproto.EInval},
		{"write on read-only", "ro", nbdproto.CmdWrite, 0, 0, 512, true, nbdproto.EPerm},
		{"trim on read-only", "ro", nbdproto.CmdTrim, 0, 0, 512, false, nbdproto.EPerm},
		{"zero on read-only", "ro", nbdproto.CmdWriteZeroes, 0, 0, 512, false, nbdproto.EPerm},
		{"unaligned read", "aligned", nbdproto.CmdRead, 0, 100, 512, false, nbdproto.EInval},
		{"unaligned length", "aligned", nbdproto.CmdWrite, 0, 512, 100, true, nbdproto.EInval},
		{"read above max block", "aligned", nbdproto.CmdRead, 0, 0, 128 << 10, false, nbdproto.EInval},
		{"write above max block", "aligned", nbdproto.CmdWrite, 0, 0, 128 << 10, true, nbdproto.EInval},
	}
	for _, tc := range tests {
		for _, structured := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/structured=%v", tc.name, structured), func(t *testing.T) {
				t.Parallel()
				rc := dialRaw(t, path)
				if _, err := rc.connect(tc.export, structured); err != nil {
					t.Fatal(err)
				}
				var payload []byte
				if tc.payload {
					payload = pattern(int(tc.length), 1)
				}
				r := rc.roundTrip(t, tc.typ, tc.flags, tc.off, tc.length, payload)
				if r.err != tc.want {
					t.Fatalf("error %d (%s), want %d", r.err, r.msg, tc.want)
				}
				if len(r.data) != 0 {
					t.Fatalf("failed request came with %d bytes of data", len(r.data))
				}
				if structured && r.msg == "" {
					t.Errorf("structured error without a message")
				}
				if r := rc.roundTrip(t, nbdproto.CmdRead, 0, 0, 4096, nil); r.err != 0 || len(r.data) != 4096 {
					t.Fatalf("read after the error: %+v", r)
				}
			})
		}
	}
	if ops := mem.opsCopy(); len(ops) != 0 {
		t.Errorf("rejected requests reached the backend: %+v", ops)
	}
}

// TestProtocolViolations: these end the connection, with no reply.
func TestProtocolViolations(t *testing.T) {
	t.Parallel()
	path := serveUnix(t, oneExportServer(newMem(1<<20), nil))
	badMagic := reqBytes(nbdproto.CmdRead, 0, 1, 0, 512, nil)
	badMagic[0] ^= 1
	tests := []struct {
		name string
		send []byte
	}{
		{"bad request magic", badMagic},
		{"write of more than the server skips", reqBytes(nbdproto.CmdWrite, 0, 1, 0, maxSkip+1, nil)},
		{"write of 4 GiB - 1", reqBytes(nbdproto.CmdWrite, 0, 1, 0, math.MaxUint32, nil)},
	}
	for _, tc := range tests {
		for _, structured := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/structured=%v", tc.name, structured), func(t *testing.T) {
				t.Parallel()
				rc, _ := mustConnect(t, path, structured)
				if err := rc.write(tc.send); err != nil {
					t.Fatal(err)
				}
				rc.expectClosed(t)
			})
		}
	}
}

func TestZeroLengthRequests(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	path := serveUnix(t, oneExportServer(mem, nil))
	for _, structured := range []bool{false, true} {
		rc, _ := mustConnect(t, path, structured)
		for _, typ := range []uint16{nbdproto.CmdRead, nbdproto.CmdWrite, nbdproto.CmdTrim, nbdproto.CmdWriteZeroes, nbdproto.CmdCache} {
			if r := rc.roundTrip(t, typ, 0, 4096, 0, nil); r.err != 0 || len(r.data) != 0 {
				t.Errorf("%s of 0 bytes: %+v", cmdName(typ), r)
			}
		}
	}
	for _, o := range mem.opsCopy() {
		if o.name != "flush" {
			t.Errorf("a zero-length request reached the backend: %+v", o)
		}
	}
}

func TestWriteFlagsReachBackend(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	path := serveUnix(t, oneExportServer(mem, nil))
	rc, _ := mustConnect(t, path, true)
	mem.fill(0x5a)
	steps := []struct {
		typ, flags uint16
		off        uint64
		length     uint32
		want       op
	}{
		{nbdproto.CmdWrite, nbdproto.CmdFlagFUA, 0, 4096, op{"write", 0, 4096, FUA}},
		{nbdproto.CmdWrite, 0, 4096, 4096, op{"write", 4096, 4096, 0}},
		{nbdproto.CmdTrim, nbdproto.CmdFlagFUA, 8192, 4096, op{"trim", 8192, 4096, FUA}},
		{nbdproto.CmdWriteZeroes, nbdproto.CmdFlagNoHole, 16384, 8192, op{"zero", 16384, 8192, NoHole}},
		{nbdproto.CmdWriteZeroes, nbdproto.CmdFlagFastZero | nbdproto.CmdFlagFUA, 32768, 4096, op{"zero", 32768, 4096, FastZero | FUA}},
		{nbdproto.CmdFlush, 0, 0, 0, op{"flush", 0, 0, 0}},
	}
	for _, s := range steps {
		var payload []byte
		if s.typ == nbdproto.CmdWrite {
			payload = pattern(int(s.length), 3)
		}
		if r := rc.roundTrip(t, s.typ, s.flags, s.off, s.length, payload); r.err != 0 {
			t.Fatalf("%s: error %d %s", cmdName(s.typ), r.err, r.msg)
		}
	}
	ops := mem.opsCopy()
	if len(ops) != len(steps) {
		t.Fatalf("backend saw %+v", ops)
	}
	for i, s := range steps {
		if ops[i] != s.want {
			t.Errorf("step %d: backend saw %+v, want %+v", i, ops[i], s.want)
		}
	}
	data := mem.snapshot()
	for _, z := range [][2]int{{8192, 12288}, {16384, 24576}, {32768, 36864}} {
		for i := z[0]; i < z[1]; i++ {
			if data[i] != 0 {
				t.Fatalf("byte %d not zero after trim/zero", i)
			}
		}
	}
}

func TestZeroAndTrimFallbacks(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	mem.noZero, mem.noTrim = true, true
	path := serveUnix(t, oneExportServer(mem, nil))
	rc, _ := mustConnect(t, path, true)
	mem.fill(1)
	// FAST_ZERO: the backend cannot, so the answer is a quick ENOTSUP and nothing changes.
	if r := rc.roundTrip(t, nbdproto.CmdWriteZeroes, nbdproto.CmdFlagFastZero, 0, 300<<10, nil); r.err != nbdproto.ENotSup {
		t.Fatalf("fast zero: error %d, want ENOTSUP", r.err)
	}
	if mem.snapshot()[0] == 0 {
		t.Fatal("failed fast zero changed data")
	}
	// Without FAST_ZERO the server writes the zeroes itself (300 KiB spans two chunks).
	if r := rc.roundTrip(t, nbdproto.CmdWriteZeroes, nbdproto.CmdFlagFUA, 4096, 300<<10, nil); r.err != 0 {
		t.Fatalf("zero: error %d %s", r.err, r.msg)
	}
	data := mem.snapshot()
	for i := 4096; i < 4096+300<<10; i++ {
		if data[i] != 0 {
			t.Fatalf("byte %d not zeroed", i)
		}
	}
	if data[4095] == 0 || data[4096+300<<10] == 0 {
		t.Fatal("zeroing spilled outside the range")
	}
	if mem.flushes.Load() != 1 {
		t.Errorf("FUA zero fallback flushed %d times, want 1", mem.flushes.Load())
	}
	// TRIM is a hint: ENOTSUP from the backend is success.
	if r := rc.roundTrip(t, nbdproto.CmdTrim, 0, 0, 4096, nil); r.err != 0 {
		t.Fatalf("trim: error %d", r.err)
	}
}

func TestBackendErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		err    error
		op     string
		typ    uint16
		want   uint32
		errOff int64
	}{
		{"EIO on read", fmt.Errorf("disk: %w", syscall.EIO), "read", nbdproto.CmdRead, nbdproto.EIO, -1},
		{"unknown error on read is EIO", errors.New("tag mismatch"), "read", nbdproto.CmdRead, nbdproto.EIO, -1},
		{"offset error on read", &OffsetError{Offset: 8192 + 512, Err: syscall.EIO}, "read", nbdproto.CmdRead, nbdproto.EIO, 8192 + 512},
		{"offset outside request", &OffsetError{Offset: 1, Err: syscall.EIO}, "read", nbdproto.CmdRead, nbdproto.EIO, -1},
		{"ENOSPC on write", syscall.ENOSPC, "write", nbdproto.CmdWrite, nbdproto.ENoSpc, -1},
		{"EDQUOT is ENOSPC", syscall.EDQUOT, "write", nbdproto.CmdWrite, nbdproto.ENoSpc, -1},
		{"EFBIG is ENOSPC", syscall.EFBIG, "write", nbdproto.CmdWrite, nbdproto.ENoSpc, -1},
		{"EROFS is EPERM", syscall.EROFS, "write", nbdproto.CmdWrite, nbdproto.EPerm, -1},
		{"ENOMEM", syscall.ENOMEM, "zero", nbdproto.CmdWriteZeroes, nbdproto.ENoMem, -1},
		{"ESHUTDOWN", syscall.ESHUTDOWN, "flush", nbdproto.CmdFlush, nbdproto.EShutdown, -1},
		{"EINVAL on trim", syscall.EINVAL, "trim", nbdproto.CmdTrim, nbdproto.EInval, -1},
		{"EOVERFLOW", syscall.EOVERFLOW, "read", nbdproto.CmdRead, nbdproto.EOverflow, -1},
	}
	for _, tc := range tests {
		for _, structured := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/structured=%v", tc.name, structured), func(t *testing.T) {
				t.Parallel()
				mem := newMem(1 << 20)
				mem.hook = failRange(tc.op, 8192, 12288, tc.err)
				if tc.op == "flush" {
					mem.hook = failRange("flush", -1, 1, tc.err)
				}
				path := serveUnix(t, oneExportServer(mem, nil))
				rc, _ := mustConnect(t, path, structured)
				var payload []byte
				var off uint64 = 8192
				var n uint32 = 4096
				if tc.typ == nbdproto.CmdWrite {
					payload = pattern(4096, 9)
				}
				if tc.typ == nbdproto.CmdFlush {
					off, n = 0, 0
				}
				r := rc.roundTrip(t, tc.typ, 0, off, n, payload)
				if r.err != tc.want {
					t.Fatalf("error %d, want %d", r.err, tc.want)
				}
				if len(r.data) != 0 {
					t.Fatalf("failed %s sent %d bytes of data", cmdName(tc.typ), len(r.data))
				}
				if structured {
					if r.msg == "" {
						t.Error("no message")
					}
					if r.errOff != tc.errOff {
						t.Errorf("error offset %d, want %d", r.errOff, tc.errOff)
					}
				}
				// The connection goes on.
				if r := rc.roundTrip(t, nbdproto.CmdRead, 0, 0, 4096, nil); r.err != 0 || len(r.data) != 4096 {
					t.Fatalf("read after error: %+v", r)
				}
			})
		}
	}
}

// TestOutOfOrder: a slow request does not hold up the replies to later ones.
func TestOutOfOrder(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	release := blockReadAt0(mem)
	path := serveUnix(t, oneExportServer(mem, nil))
	rc, _ := mustConnect(t, path, true)
	rc.send(nbdproto.CmdRead, 0, 1, 0, 4096, nil)
	for h := uint64(2); h < 10; h++ {
		rc.send(nbdproto.CmdRead, 0, h, h*4096, 4096, nil)
	}
	for i := 0; i < 8; i++ {
		r, err := rc.readReply()
		if err != nil {
			t.Fatal(err)
		}
		if r.handle == 1 {
			t.Fatal("the blocked read was answered first")
		}
	}
	close(release)
	r, err := rc.readReply()
	if err != nil || r.handle != 1 || r.err != 0 {
		t.Fatalf("blocked read: %+v %v", r, err)
	}
}

// TestDiscWithRequestsInFlight: after NBD_CMD_DISC the server answers every request
// sent before it, flushes, and closes.
func TestDiscWithRequestsInFlight(t *testing.T) {
	t.Parallel()
	mem := newMem(4 << 20)
	mem.hook = func(name string, off, n int64, f Flags) error {
		if name == "write" {
			time.Sleep(20 * time.Millisecond)
		}
		return nil
	}
	path := serveUnix(t, oneExportServer(mem, nil))
	rc, _ := mustConnect(t, path, true)
	const n = 16
	for h := uint64(0); h < n; h++ {
		rc.send(nbdproto.CmdWrite, 0, h, h*65536, 65536, pattern(65536, byte(h)))
	}
	rc.send(nbdproto.CmdDisc, 0, 99, 0, 0, nil)
	seen := map[uint64]bool{}
	for i := 0; i < n; i++ {
		r, err := rc.readReply()
		if err != nil {
			t.Fatalf("reply %d: %v", i, err)
		}
		if r.err != 0 {
			t.Fatalf("write %d failed: %d", r.handle, r.err)
		}
		seen[r.handle] = true
	}
	if len(seen) != n {
		t.Fatalf("answered %d distinct writes", len(seen))
	}
	rc.expectClosed(t)
	ops := mem.opsCopy()
	if len(ops) != n+1 || ops[n].name != "flush" {
		t.Fatalf("backend saw %d ops, last %+v; want %d writes then a flush", len(ops), ops[len(ops)-1], n)
	}
}

// TestInFlightBounds: clients that flood the server with writes while the backend is slow
// never get more requests or payload bytes in flight than the limits allow, and do get up
// to them (the limits bind, requests run concurrently). A write that finds the shared pool
// full is streamed under its connection's reserve (stream.go), one at a time per
// connection, so each connection may add one request of streamPiece bytes.
func TestInFlightBounds(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name                string
		size                int
		perConn, global     int
		perConnBytes, bytes int64
		wantPeak            int64 // requests at once the limits allow
		perClient           int
		hold                time.Duration // backend time per request
	}{
		// 2 MiB requests do not fit a connection's reserve (reserveBytes), so only the
		// shared pool's count binds.
		{"count bound", 2 << 20, 4, 10, MaxRequest, MaxRequest, 10, 12, 200 * time.Millisecond},
		// 9 × 8 MiB must cross the socket while the first is held, even on a busy machine.
		{"byte bound", 8 << 20, 16, 64, MaxRequest, MaxRequest + 8<<20, 9, 4, 500 * time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			mem := newMem(64 << 20)
			var cur, peak, curBytes, peakBytes atomic.Int64
			// The first requests are held until as many as the limits allow are in
			// the backend (or 20 s pass), so that a busy machine, slow to send them
			// all, still shows the peak; every whole request is then held for
			// tc.hold, so that more would pile up if the limits failed.
			full := make(chan struct{})
			var fullOnce sync.Once
			markFull := func() { fullOnce.Do(func() { close(full) }) }
			mem.hook = func(name string, off, n int64, f Flags) error {
				c := cur.Add(1)
				b := curBytes.Add(n)
				for p := peak.Load(); c > p && !peak.CompareAndSwap(p, c); p = peak.Load() {
				}
				for p := peakBytes.Load(); b > p && !peakBytes.CompareAndSwap(p, b); p = peakBytes.Load() {
				}
				if c >= tc.wantPeak {
					markFull()
				}
				if n <= streamPiece {
					// A piece of a streamed write: counted, not held, or a write of
					// many pieces would take many holds.
					cur.Add(-1)
					curBytes.Add(-n)
					return nil
				}
				select {
				case <-full:
				case <-time.After(20 * time.Second):
					markFull()
				}
				time.Sleep(tc.hold)
				cur.Add(-1)
				curBytes.Add(-n)
				return nil
			}
			srv := oneExportServer(mem, nil)
			srv.MaxInFlightPerConn = tc.perConn
			srv.MaxBytesPerConn = tc.perConnBytes
			srv.MaxInFlight = tc.global
			srv.MaxBytes = tc.bytes
			path := serveUnix(t, srv)

			const clients = 3
			perClient := tc.perClient
			var wg sync.WaitGroup
			for c := 0; c < clients; c++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rc := dialRaw(t, path)
					if _, err := rc.connect("", true); err != nil {
						t.Error(err)
						return
					}
					payload := pattern(tc.size, byte(c))
					go func() {
						for h := uint64(0); h < uint64(perClient); h++ {
							if err := rc.send(nbdproto.CmdWrite, 0, h, (h%6)*uint64(tc.size), uint32(tc.size), payload); err != nil {
								t.Error(err)
								return
							}
						}
					}()
					for i := 0; i < perClient; i++ {
						if r, err := rc.readReply(); err != nil || r.err != 0 {
							t.Errorf("reply: %+v %v", r, err)
							return
						}
					}
				}()
			}
			wg.Wait()
			t.Logf("peak %d requests, %d MiB in the backend", peak.Load(), peakBytes.Load()>>20)
			if p := peak.Load(); p > tc.wantPeak+clients {
				t.Errorf("%d requests in the backend at once, limits allow %d and a streamed one per connection", p, tc.wantPeak)
			}
			if p := peakBytes.Load(); p > tc.bytes+clients*streamPiece {
				t.Errorf("%d bytes in the backend at once, limit %d and a streamed piece per connection", p, tc.bytes)
			}
			if p := peak.Load(); p < tc.wantPeak-1 && !raceEnabled {
				t.Errorf("peak %d requests at once: the limits (%d) never bound, or requests were serialised", p, tc.wantPeak)
			}
		})
	}
}

// cachingMem adds the optional Cacher to memBackend.
type cachingMem struct {
	*memBackend
	calls chan [2]int64
}

func (c cachingMem) Cache(off, n int64) error {
	c.calls <- [2]int64{off, n}
	return nil
}

func TestCache(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	cm := cachingMem{mem, make(chan [2]int64, 1)}
	path := serveUnix(t, oneExportServer(cm, nil))
	rc, _ := mustConnect(t, path, true)
	if r := rc.roundTrip(t, nbdproto.CmdCache, 0, 8192, 65536, nil); r.err != 0 {
		t.Fatalf("cache: error %d", r.err)
	}
	if got := <-cm.calls; got != [2]int64{8192, 65536} {
		t.Fatalf("Cache called with %v", got)
	}
	// Without Cacher, CACHE succeeds and does nothing.
	path = serveUnix(t, oneExportServer(newMem(1<<20), nil))
	rc, _ = mustConnect(t, path, false)
	if r := rc.roundTrip(t, nbdproto.CmdCache, 0, 0, 4096, nil); r.err != 0 {
		t.Fatalf("cache without Cacher: error %d", r.err)
	}
}

// TestClientGoneMidWrite: a client that disconnects in the middle of a write's payload
// loses that write, and only that write: the backend never sees a partial payload, the
// writes it completed before stay, and the server goes on serving other clients.
func TestClientGoneMidWrite(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	path := serveUnix(t, oneExportServer(mem, nil))
	rc, _ := mustConnect(t, path, true)
	done := pattern(4096, 1)
	if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 0, 4096, done); r.err != 0 {
		t.Fatalf("first write: error %d", r.err)
	}
	// Header for 64 KiB at offset 64 KiB, then a fifth of the payload, then hang up.
	hdr := reqBytes(nbdproto.CmdWrite, 0, 7, 65536, 65536, nil)
	if err := rc.write(append(hdr, pattern(65536, 2)[:13107]...)); err != nil {
		t.Fatal(err)
	}
	rc.c.Close()

	// A new client sees the first write and nothing of the torn one.
	rc2, _ := mustConnect(t, path, true)
	r := rc2.roundTrip(t, nbdproto.CmdRead, 0, 0, 4096, nil)
	mustEqual(t, "completed write", r.data, done)
	r = rc2.roundTrip(t, nbdproto.CmdRead, 0, 65536, 65536, nil)
	mustEqual(t, "torn write's range", r.data, make([]byte, 65536))
	for _, op := range mem.opsCopy() {
		if op.name == "write" && op.off == 65536 {
			t.Fatalf("the backend saw the torn write: %+v", op)
		}
	}
}

//go:build ceph

package integration

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/integration/ceph"
	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/nbdclient"
)

// eli on a real single-node Ceph cluster (integration/ceph): an RBD image with
// exclusive-lock, exported by qemu-nbd's rbd driver as the README shows, is eli's
// remote provider. The cluster's daemons and their faults would skew the timing of the
// other integration tests, so these build only with -tags ceph and run in a step of
// their own in scripts/test ("== ceph").

const cephPool = "eli"

// cephWatchTimeout is the cluster's osd_client_watch_timeout. A gateway killed with
// SIGKILL keeps the image's exclusive lock until the OSD drops its watch, and eli's
// requests wait that long; Ceph's default (30 s) would leave the restart tests racing
// eli's remote request timeout on a busy machine. The README advises the same setting.
const cephWatchTimeout = 10 * time.Second

// cephHangGuard bounds every wait for I/O to go on after a fault: far beyond what the
// faults take, it only turns a hang into a failure.
const cephHangGuard = 3 * time.Minute

// TestCeph brings up one cluster and runs its subtests on it one after another (the
// OSD test stops the whole cluster's I/O).
func TestCeph(t *testing.T) {
	e := newEnv(t, false)
	began := time.Now()
	cl := ceph.Start(t, e.mkdirTemp("", "ceph"))
	cl.SetWatchTimeout(t, cephWatchTimeout)
	cl.CreatePool(t, cephPool)
	t.Logf("cluster and pool ready in %v", time.Since(began).Round(time.Millisecond))

	t.Run("RoundTripCiphertextOnly", func(t *testing.T) { cephRoundTrip(t, cl) })
	t.Run("GatewayRestart", func(t *testing.T) { cephGatewayRestart(t, cl) })
	t.Run("GatewayOutage", func(t *testing.T) { cephGatewayOutage(t, cl) })
	t.Run("OSDRestart", func(t *testing.T) { cephOSDRestart(t, cl) })
}

// cephVolume is an eli volume on a new RBD image of the cluster, served by a gateway.
func cephVolume(t *testing.T, cl *ceph.Cluster, image string) (*env, *ceph.Gateway) {
	t.Helper()
	e := newEnv(t, false)
	cl.CreateImage(t, cephPool, image, 64<<20)
	var info struct {
		Features []string `json:"features"`
	}
	if err := json.Unmarshal([]byte(cl.Run(t, "rbd", "info", "--format", "json", cephPool+"/"+image)), &info); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(info.Features, ","), "exclusive-lock") {
		t.Fatalf("image %s has features %v, want exclusive-lock", image, info.Features)
	}
	gw := cl.Gateway(t, cephPool, image, e.mkdirTemp("", "gw"))
	e.remoteInit(gw.URI)
	return e, gw
}

// cephRoundTrip: eli init and attach over the RBD export; a pattern written with
// nbdcopy reads back the same, also after detach and re-attach; and no object in the
// pool, read with rados past every gateway, holds any of it.
func cephRoundTrip(t *testing.T, cl *ceph.Cluster) {
	e, gw := cephVolume(t, cl, "roundtrip")

	// Two halves: a low-entropy marker repeated, which any copy of a sector in clear
	// would show, and random bytes, which no compression or encoding of RADOS's own
	// could make appear by chance.
	const half = 4 << 20
	marker := []byte("ELI-CEPH-PLAINTEXT-MARKER-0123456789abcdef")
	plain := make([]byte, 2*half)
	for i := 0; i < half; i += copy(plain[i:half], marker) {
	}
	fillRandom(rand.New(rand.NewPCG(38, 1)), plain[half:])
	src := e.Path("plain")
	if err := os.WriteFile(src, plain, 0o600); err != nil {
		t.Fatal(err)
	}

	uri := e.Attach(gw.URI, "--name", "rt")
	nbdcopyIn(t, src, uri) // writes, then flushes
	want, n := exportHash(t, uri)
	e.detach("rt")

	uri = e.Attach(gw.URI, "--name", "rt")
	if got, m := exportHash(t, uri); got != want || m != n {
		t.Fatalf("after re-attach the export reads %x (%d bytes), want %x (%d)", got, m, want, n)
	}
	back := []byte(pythonNBD(t, nil, "pread", uri, "0", fmt.Sprint(len(plain))))
	if !bytes.Equal(back, plain) {
		t.Fatal("the pattern read back through libnbd after re-attach differs from what was written")
	}
	e.detach("rt")

	// What RADOS holds. First that the objects are the image's bytes (eli's header,
	// read raw through the gateway, opens the image's first data object), so that the
	// search below looks at the right thing.
	raw, err := nbdclient.Dial("unix", gw.Sock, "")
	if err != nil {
		t.Fatal(err)
	}
	head := make([]byte, 4096)
	if err := raw.ReadAt(head, 0); err != nil {
		t.Fatal(err)
	}
	raw.Close()
	objs := cl.Objects(t, cephPool)
	var data int
	sawHead := false
	for name, b := range objs {
		if !strings.HasPrefix(name, "rbd_data.") {
			continue
		}
		data += len(b)
		if strings.HasSuffix(name, ".0000000000000000") && bytes.HasPrefix(b, head) {
			sawHead = true
		}
	}
	if !sawHead {
		t.Fatalf("no rbd_data object of pool %s starts with the image's first 4 KiB (%d objects)", cephPool, len(objs))
	}
	if data < len(plain) {
		t.Fatalf("the pool's data objects hold %d bytes, less than the %d written through eli", data, len(plain))
	}
	// Then that none of the plaintext is there: not the marker, and no 16 bytes of the
	// random half that start at a multiple of 512 in it, at any offset of any object
	// (which catches any run of 527 bytes or more of it, whatever its alignment).
	needles := make(map[[16]byte]int)
	for i := half; i+16 <= len(plain); i += 512 {
		needles[[16]byte(plain[i:i+16])] = i
	}
	for name, b := range objs {
		if bytes.Contains(b, marker) {
			t.Fatalf("object %s holds the plaintext marker", name)
		}
		for j := 0; j+16 <= len(b); j++ {
			if i, ok := needles[[16]byte(b[j:j+16])]; ok {
				t.Fatalf("object %s holds plaintext at %d (byte %d of what was written)", name, j, i)
			}
		}
	}
	t.Logf("%d objects (%d bytes of image data) hold no plaintext", len(objs), data)
}

// cephGatewayRestart: qemu-nbd stopped (SIGTERM: it closes the image and gives up the
// lock) and then killed (SIGKILL: the lock outlives it until the OSD drops its watch),
// each time restarted on the same socket, while a client writes and flushes through
// eli: every request succeeds, I/O goes on after each restart, and every block holds
// what was last written to it, while attached and after a re-attach.
func cephGatewayRestart(t *testing.T, cl *ceph.Cluster) {
	e, gw := cephVolume(t, cl, "gateway")
	uri := e.Attach(gw.URI, "--name", "gw")
	w := startLoad(t, uri, 1, nil)
	w.waitFlushes(t, 10, "before the first restart")
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		before := blocklist(t, cl)
		gw.Kill(sig)
		gw.Start(t)
		restarted := time.Now()
		w.waitFlushes(t, w.flushCount()+10, fmt.Sprintf("after qemu-nbd's restart (%v)", sig))
		t.Logf("qemu-nbd %v and restarted: I/O went on; 10 flushes done %v after the restart",
			sig, time.Since(restarted).Round(time.Millisecond))
		// A stopped gateway gave its lock up; a killed one's was broken, and its
		// client blocklisted, by the new gateway's first write (what the README says).
		want := len(before)
		if sig == syscall.SIGKILL {
			want++
		}
		if after := blocklist(t, cl); len(after) != want {
			t.Fatalf("after qemu-nbd %v and its restart the OSD blocklist holds %v, before %v: want %d entries",
				sig, after, before, want)
		}
	}
	sums := w.finish(t, e, "gw")
	if log := e.serverLog("gw"); !strings.Contains(log, "reconnected") {
		t.Fatalf("the server log does not show a reconnection:\n%s", log)
	}
	checkBlocks(t, uri, sums, "while attached")
	e.detach("gw")
	uri = e.Attach(gw.URI, "--name", "gw")
	checkBlocks(t, uri, sums, "after re-attach")
	e.detach("gw")
}

// cephGatewayOutage: with Ceph's default osd_client_watch_timeout (30 s), a killed
// qemu-nbd restarted at once leaves eli's requests waiting about that long for the
// image's lock, which eli's remote request timeout, 30 s and fixed, used to race; with
// attach's defaults they are held and complete. Then qemu-nbd killed and kept down 40 s,
// past that old timeout, under --queue-timeout forever (dm-multipath's
// queue_if_no_path): the requests wait out the whole outage, none fails, and no flushed
// write is lost, across both attaches and a third.
func cephGatewayOutage(t *testing.T, cl *ceph.Cluster) {
	cl.SetWatchTimeout(t, 0)
	defer cl.SetWatchTimeout(t, cephWatchTimeout)
	e, gw := cephVolume(t, cl, "outage")

	uri := e.Attach(gw.URI, "--name", "out")
	w := startLoad(t, uri, 3, nil)
	w.waitFlushes(t, 10, "before the kill")
	gw.Kill(syscall.SIGKILL)
	gw.Start(t)
	w.waitFlushes(t, w.flushCount()+10, "after qemu-nbd's restart with Ceph's default watch timeout")
	sums := w.finish(t, e, "out")
	t.Logf("qemu-nbd killed and restarted at once, Ceph's default watch timeout: the longest request waited %v",
		w.maxWait.Round(time.Millisecond))
	e.detach("out")

	const down = 40 * time.Second
	uri = e.Attach(gw.URI, "--name", "out", "--queue-timeout", "forever")
	w = startLoad(t, uri, 4, sums)
	w.waitFlushes(t, 10, "before the outage")
	gw.Kill(syscall.SIGKILL)
	time.Sleep(down / 2)
	t.Logf("eli status %v into the outage:\n%s", down/2, e.OK("status", "out").Stdout)
	time.Sleep(down - down/2)
	gw.Start(t)
	w.waitFlushes(t, w.flushCount()+10, fmt.Sprintf("after an outage of %v", down))
	sums = w.finish(t, e, "out")
	if w.maxWait < down*3/4 {
		t.Fatalf("the longest request waited %v through an outage of %v: the requests were not held", w.maxWait, down)
	}
	t.Logf("qemu-nbd down %v: the longest request waited %v and completed", down, w.maxWait.Round(time.Millisecond))
	checkBlocks(t, uri, sums, "while attached")
	e.detach("out")
	uri = e.Attach(gw.URI, "--name", "out")
	checkBlocks(t, uri, sums, "after re-attach")
	e.detach("out")
}

// blocklist is the cluster's list of blocklisted client addresses.
func blocklist(t *testing.T, cl *ceph.Cluster) []string {
	t.Helper()
	var entries []struct {
		Addr string `json:"addr"`
	}
	// Ceph 16.2 prints the list twice: the first value is the list.
	out := cl.Run(t, "ceph", "osd", "blocklist", "ls", "--format", "json")
	if err := json.NewDecoder(strings.NewReader(out)).Decode(&entries); err != nil {
		t.Fatalf("ceph osd blocklist ls: %v\n%s", err, out)
	}
	var addrs []string
	for _, e := range entries {
		addrs = append(addrs, e.Addr)
	}
	return addrs
}

// cephOSDRestart: the cluster's only OSD killed with SIGKILL and restarted at once, then
// killed and left down for a while, under the same load: every request succeeds (RADOS
// holds them until the OSD is back), and no flushed write is lost.
func cephOSDRestart(t *testing.T, cl *ceph.Cluster) {
	e, gw := cephVolume(t, cl, "osd")
	uri := e.Attach(gw.URI, "--name", "osd")
	w := startLoad(t, uri, 2, nil)
	w.waitFlushes(t, 10, "before the first kill")
	for _, down := range []time.Duration{0, 8 * time.Second} {
		cl.KillOSD(syscall.SIGKILL)
		time.Sleep(down)
		restarted := time.Now()
		cl.StartOSD(t)
		active := time.Since(restarted)
		w.waitFlushes(t, w.flushCount()+10, fmt.Sprintf("after the OSD's restart (down %v)", down))
		t.Logf("OSD killed, down %v, active %v after its restart; 10 flushes done %v after the restart",
			down, active.Round(time.Millisecond), time.Since(restarted).Round(time.Millisecond))
	}
	sums := w.finish(t, e, "osd")
	checkBlocks(t, uri, sums, "while attached")
	t.Logf("peak resident memory: mon and osd %d MiB, qemu-nbd %d MiB; the OSD's file takes %d MiB on disk",
		cl.PeakRSS()>>20, gw.PeakRSS()>>20, cl.DiskUsage()>>20)
	e.detach("osd")
	uri = e.Attach(gw.URI, "--name", "osd")
	checkBlocks(t, uri, sums, "after re-attach")
	e.detach("osd")
}

// The load: 64 KiB writes of random data to random blocks of the first 16 MiB, a flush
// after every eighth, on one connection to eli's export.
const loadBlock, loadBlocks = 64 << 10, 256

// loadWriter writes and flushes through an NBD client until stopped, and records the
// SHA-256 of the last data written to each block.
type loadWriter struct {
	c       *nbdclient.Client
	mu      sync.Mutex
	sums    map[int64][32]byte
	writes  int
	flushes int
	maxWait time.Duration // the longest a write or flush took
	err     error
	stop    chan struct{}
	done    chan struct{}
}

// startLoad starts a writer on uri; sums, if not nil, are the digests of what the
// volume's blocks hold already.
func startLoad(t *testing.T, uri string, seed uint64, sums map[int64][32]byte) *loadWriter {
	t.Helper()
	c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	if sums == nil {
		sums = make(map[int64][32]byte)
	}
	w := &loadWriter{c: c, sums: sums, stop: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() {
		w.halt()
		c.Close()
	})
	go w.run(seed)
	return w
}

func (w *loadWriter) run(seed uint64) {
	defer close(w.done)
	rng := rand.New(rand.NewPCG(seed, 38))
	p := make([]byte, loadBlock)
	for i := 0; ; i++ {
		select {
		case <-w.stop:
			return
		default:
		}
		k := rng.Int64N(loadBlocks)
		fillRandom(rng, p)
		began := time.Now()
		if err := w.c.WriteAt(p, k*loadBlock, false); err != nil {
			w.fail(fmt.Errorf("write %d (block %d) after %v: %w", i, k, time.Since(began), err))
			return
		}
		w.mu.Lock()
		w.sums[k] = sha256.Sum256(p)
		w.writes++
		w.maxWait = max(w.maxWait, time.Since(began))
		w.mu.Unlock()
		if i%8 == 7 {
			began := time.Now()
			if err := w.c.Flush(); err != nil {
				w.fail(fmt.Errorf("flush after write %d, after %v: %w", i, time.Since(began), err))
				return
			}
			w.mu.Lock()
			w.flushes++
			w.maxWait = max(w.maxWait, time.Since(began))
			w.mu.Unlock()
		}
	}
}

func (w *loadWriter) fail(err error) {
	w.mu.Lock()
	w.err = err
	w.mu.Unlock()
}

func (w *loadWriter) flushCount() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.flushes
}

// waitFlushes waits until n flushes have succeeded, failing the test if the writer
// fails or stops making progress for cephHangGuard.
func (w *loadWriter) waitFlushes(t *testing.T, n int, when string) {
	t.Helper()
	deadline := time.Now().Add(cephHangGuard)
	for {
		w.mu.Lock()
		f, err := w.flushes, w.err
		w.mu.Unlock()
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		if f >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d flushes, want %d: no progress within %v", when, f, n, cephHangGuard)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (w *loadWriter) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	<-w.done
}

// finish stops the writer, fails the test if any request failed, flushes once more and
// returns the digest of each block written.
func (w *loadWriter) finish(t *testing.T, e *env, name string) map[int64][32]byte {
	t.Helper()
	w.halt()
	if w.err != nil {
		t.Fatalf("a request failed: %v\nserver log:\n%s", w.err, e.serverLog(name))
	}
	if err := w.c.Flush(); err != nil {
		t.Fatal(err)
	}
	w.c.Close()
	if st := e.OK("status", name).Stdout; !strings.Contains(st, "serving") {
		t.Fatalf("status after the load:\n%s", st)
	}
	t.Logf("%d writes, %d flushes, %d blocks written, 0 failed", w.writes, w.flushes, len(w.sums))
	return w.sums
}

// checkBlocks reads every block of the load's range with libnbd and compares each with
// the digest of what was last written to it (zeroes where nothing was).
func checkBlocks(t *testing.T, uri string, sums map[int64][32]byte, when string) {
	t.Helper()
	idx := make([]int64, loadBlocks)
	for i := range idx {
		idx[i] = int64(i)
	}
	zero := sha256.Sum256(make([]byte, loadBlock))
	got := readSectors(t, uri, loadBlock, idx...)
	bad := 0
	for _, k := range idx {
		want, ok := sums[k]
		if !ok {
			want = zero
		}
		if r := got[k]; !r.ok || r.hash != want {
			bad++
			if bad <= 5 {
				t.Errorf("%s: block %d: read ok=%v errno=%s, digest %x, want %x", when, k, r.ok, r.errno, r.hash[:8], want[:8])
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%s: %d of %d blocks differ from what was last written and flushed", when, bad, loadBlocks)
	}
}

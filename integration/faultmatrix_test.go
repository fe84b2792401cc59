package integration

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/faultproxy"
	"github.com/elidisk/eli/nbdclient"
)

// The fault matrix of issue 38: eli over a remote NBD provider (nbdkit's file plugin
// behind internal/faultproxy) through each storage fault, with a client writing and
// flushing throughout. For every fault:
//
//   - no acknowledged flush is lost or changed: after the storage is back, a fresh
//     attach reads, for every block, what the last successful flush covered, or a
//     value written after it;
//   - the client gets data or an error for each request within matrixBound, never a
//     hang;
//   - eli status names the fault while it lasts;
//   - detach ends within its --timeout, and exits 0 when the final commit reached the
//     storage, 1 (saying what is safe) when not; the name is free afterwards;
//   - a fresh attach works once the storage is back.
//
// The volumes are attached with --io-timeout 1s --queue-timeout 10s instead of the
// defaults (30 s and 2 m) so that the matrix runs in a minute: the code paths are the
// same, and every stall is set against those timeouts as the defaults would set a
// real one (a 3 s stall is three request timeouts, within the queue timeout; the
// storage killed for good outlasts it).
const (
	matrixIO    = time.Second
	matrixQueue = 10 * time.Second
	// matrixBound is what a client request may take at most: the queue timeout, one
	// request timeout, and room for a loaded machine.
	matrixBound = matrixQueue + matrixIO + 15*time.Second
)

type fault struct {
	name string
	// inject starts the fault; it returns what ends it (nil: the fault lasts until
	// detach, as storage killed for good).
	inject func(t *testing.T, p *faultproxy.Proxy, e *env) (end func())
	// status is what eli status must say while the fault lasts ("" for nothing).
	status string
	// cleanDetach: detach must exit 0 (the final commit reached the storage); false:
	// it must exit 1; nil-like "either" when the fault may or may not fail a commit.
	detach detachWant
}

type detachWant int

const (
	detachOK detachWant = iota
	detachFails
	detachEither
)

func TestFaultMatrix(t *testing.T) {
	t.Parallel()
	faults := []fault{
		{name: "storage killed for good", status: "unreachable", detach: detachFails,
			inject: func(t *testing.T, p *faultproxy.Proxy, e *env) func() {
				p.Kill()
				return nil
			}},
		{name: "killed and restarted", status: "unreachable", detach: detachOK,
			inject: func(t *testing.T, p *faultproxy.Proxy, e *env) func() {
				p.Kill()
				return func() {
					if err := p.Restart(); err != nil {
						t.Error(err)
					}
				}
			}},
		{name: "stalled then resumed", status: "storage:", detach: detachOK,
			inject: func(t *testing.T, p *faultproxy.Proxy, e *env) func() {
				p.Stall()
				return p.Resume
			}},
		{name: "every write failing", status: "failed", detach: detachFails,
			inject: func(t *testing.T, p *faultproxy.Proxy, e *env) func() {
				p.FailWrites(true)
				return func() { p.FailWrites(false) }
			}},
		{name: "10% of reads failing", status: "last error", detach: detachEither,
			inject: func(t *testing.T, p *faultproxy.Proxy, e *env) func() {
				p.FailReads(0.1)
				return func() { p.FailReads(0) }
			}},
		{name: "connection cut every second", status: "re-established", detach: detachOK,
			inject: func(t *testing.T, p *faultproxy.Proxy, e *env) func() {
				stop := make(chan struct{})
				go p.CutEvery(time.Second, stop)
				return func() { close(stop) }
			}},
		{name: "export replaced by another volume", status: "replaced", detach: detachFails,
			inject: func(t *testing.T, p *faultproxy.Proxy, e *env) func() {
				other := newStorage(e, "nbdkit", 32<<20, nil, nil)
				e.remoteInit(other.uri) // another volume, with its own ownership block
				orig := p.Upstream()
				p.SetUpstream("unix", other.sock)
				p.Cut()
				return func() {
					p.SetUpstream("unix", orig)
					p.Cut()
				}
			}},
	}
	for _, f := range faults {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			runFault(t, f)
		})
	}
}

// matrixClient writes random 64 KiB blocks and flushes every fourth write, keeping for
// each block what a successful flush made durable and what was written since.
type matrixClient struct {
	t       *testing.T
	c       *nbdclient.Client
	mu      sync.Mutex
	durable [][]byte   // per block: the value its last successful flush covered (nil: zeroes)
	since   [][][]byte // per block: values written (acknowledged or not) since then
	acked   [][]byte   // per block: the last value a write acknowledged
	errs    int
	ok      int
	slowest time.Duration
}

const (
	mSector = 4096 // eli init's default sector size, the unit a crash keeps whole
	mBlock  = 64 << 10
	mBlocks = 64
	mBase   = 1 << 20 // away from what the test wrote at attach
)

func (m *matrixClient) run(stop <-chan struct{}, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 38))
	var written []int // blocks acknowledged since the last flush
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		k := rng.IntN(mBlocks)
		p := make([]byte, mBlock)
		fillRandom(rng, p)
		m.mu.Lock()
		m.since[k] = append(m.since[k], p)
		m.mu.Unlock()
		err := m.timed(func() error { return m.c.WriteAt(p, mBase+int64(k)*mBlock, false) })
		if err == nil {
			written = append(written, k)
			m.mu.Lock()
			m.acked[k] = p
			m.mu.Unlock()
		}
		if i%4 == 3 {
			if m.timed(m.c.Flush) == nil {
				m.mu.Lock()
				// Everything acknowledged before the flush is durable: a block's last
				// acknowledged value is what it holds from now on.
				for _, b := range written {
					m.durable[b], m.since[b] = m.acked[b], nil
				}
				m.mu.Unlock()
				written = written[:0]
			}
		}
		if err != nil {
			time.Sleep(50 * time.Millisecond) // a failed volume fails at once: do not spin
		}
	}
}

// timed runs one request, counting its outcome and its time.
func (m *matrixClient) timed(f func() error) error {
	start := time.Now()
	err := f()
	d := time.Since(start)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.slowest = max(m.slowest, d)
	if d > 2*matrixIO {
		m.t.Logf("a request took %v: %v", d, err)
	}
	if err != nil {
		m.errs++
	} else {
		m.ok++
	}
	return err
}

func runFault(t *testing.T, f fault) {
	e := newEnv(t, true)
	st, p, uri := proxiedStorage(e, 32<<20)
	e.remoteInit(uri)
	attach := func() string {
		if why := st.exited(); why != "" {
			t.Fatalf("the storage server died: %s", why)
		}
		return e.Attach(uri, "--name", "m", "--io-timeout", matrixIO.String(), "--queue-timeout", matrixQueue.String())
	}
	export := attach()
	pid := e.Attached("m").Pid
	c, err := nbdclient.Dial("unix", strings.TrimPrefix(export, "nbd+unix:///?socket="), "")
	if err != nil {
		t.Fatal(err)
	}
	m := &matrixClient{t: t, c: c, durable: make([][]byte, mBlocks), since: make([][][]byte, mBlocks), acked: make([][]byte, mBlocks)}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { defer close(done); m.run(stop, uint64(len(f.name))) }()

	time.Sleep(time.Second) // some writes and flushes before the fault
	end := f.inject(t, p, e)
	// status names the fault while it lasts.
	named := false
	for deadline := time.Now().Add(matrixQueue); time.Now().Before(deadline) && !named; time.Sleep(200 * time.Millisecond) {
		r := e.Run("", "status", "m")
		named = strings.Contains(r.Stdout, f.status) || strings.Contains(r.Stderr, f.status)
		if named {
			t.Logf("status during the fault:\n%s%s", r.Stdout, r.Stderr)
		}
	}
	if !named {
		t.Errorf("eli status does not name the fault (want %q):\n%v", f.status, e.Run("", "status", "m"))
	}
	if end != nil {
		time.Sleep(3 * matrixIO) // the fault lasts three request timeouts, within the queue timeout
		end()
		time.Sleep(2 * time.Second) // writes and flushes after it
	} else {
		time.Sleep(matrixQueue + 2*time.Second) // past the queue timeout: requests fail
	}
	close(stop)
	select {
	case <-done:
	case <-time.After(2 * matrixBound):
		t.Fatal("the client is stuck") // a hang guard; the bound is checked below
	}
	c.Close()
	m.mu.Lock()
	t.Logf("client: %d requests answered, %d failed, slowest %v", m.ok, m.errs, m.slowest)
	if m.slowest > matrixBound {
		t.Errorf("a request took %v, more than %v", m.slowest, matrixBound)
	}
	m.mu.Unlock()
	if f.detach == detachOK && m.errs > 0 {
		t.Errorf("%d requests failed through a fault the queue timeout covers", m.errs)
	}

	const timeout = 20 * time.Second
	r, took := timed(e, "detach", "--timeout", timeout.String(), "m")
	if took > timeout+5*time.Second {
		t.Errorf("detach took %v with --timeout %v", took, timeout)
	}
	switch {
	case f.detach == detachOK && r.Code != 0:
		t.Errorf("detach after the storage recovered: %v\nserver log:\n%s", r, e.serverLog("m"))
	case f.detach == detachFails && (r.Code != 1 || !strings.Contains(r.Stderr, "safe")):
		t.Errorf("detach after a fault that stopped the volume: want exit 1 saying what is safe: %v", r)
	case r.Code != 0 && r.Code != 1:
		t.Errorf("detach: %v", r)
	}
	if alive(e, pid) || len(listed(e)) != 0 {
		t.Fatalf("after detach: server alive %v, list %+v", alive(e, pid), listed(e))
	}

	if end == nil {
		if err := p.Restart(); err != nil {
			t.Fatal(err)
		}
	}
	export = attach()
	c, err = nbdclient.Dial("unix", strings.TrimPrefix(export, "nbd+unix:///?socket="), "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got := make([]byte, mBlock)
	zero := make([]byte, mBlock)
	for k := range mBlocks {
		if err := c.ReadAt(got, mBase+int64(k)*mBlock); err != nil {
			t.Fatalf("block %d after the fault: %v", k, err)
		}
		// Sector by sector: a commit cut by the fault leaves each sector of a write
		// not flushed yet old or new, not the whole write (a CI run found a block with
		// some of each).
		for s := 0; s < mBlock; s += mSector {
			part := got[s : s+mSector]
			ok := m.durable[k] == nil && bytes.Equal(part, zero[s:s+mSector]) ||
				m.durable[k] != nil && bytes.Equal(part, m.durable[k][s:s+mSector])
			for _, v := range m.since[k] {
				ok = ok || bytes.Equal(part, v[s:s+mSector])
			}
			if !ok {
				t.Fatalf("block %d, sector %d, holds neither what its last successful flush covered nor a later write", k, s/mSector)
			}
		}
	}
	c.Close()
	e.detach("m")
}

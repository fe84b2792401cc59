package integration

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/nbdclient"
)

// Scenario 4 (issue 6): kill -9 during writes. A writer streams writes (aligned and not,
// FUA, write-zeroes, trims) with flushes in between; the server is SIGKILLed at a random
// moment; after each re-attach every sector must read (no EIO, the whole device) and hold
// a value it may hold by docs/design.md's guarantee: the value it had at the last completed
// flush (or FUA write), or one written since. A kill is a process crash, not a power cut:
// what reached the page cache survives, so this checks eli's commit and recovery logic
// (journal, intent, records) rather than the disk's.
//
// Bounded: a few rounds of well under a second of writing each. Seeded: the seed is
// logged and ELI_KILL_SEED=N repeats the same writes and delays (the kill still lands
// where the scheduler puts it).

// crashModel tracks, per sector, the contents a read may return after a crash.
type crashModel struct {
	s       int64
	cur     [][]byte              // the sector as the last write sent left it
	allowed []map[[32]byte]string // hash → which write produced it (for messages)
	dirty   map[int64]bool        // sectors written since their last flush or FUA write
}

func newCrashModel(n, s int64) *crashModel {
	m := &crashModel{s: s, cur: make([][]byte, n), allowed: make([]map[[32]byte]string, n), dirty: map[int64]bool{}}
	zero := sha256.Sum256(make([]byte, s))
	for i := range m.cur {
		m.cur[i] = make([]byte, s)
		m.allowed[i] = map[[32]byte]string{zero: "never written"}
	}
	return m
}

// write records that p is about to be written at off (nil p: zeroes of length n). Before
// the request is sent, since a request without a reply may or may not have happened.
func (m *crashModel) write(off int64, p []byte, n int64, what string) {
	for i := off / m.s; i*m.s < off+n; i++ {
		sec := m.cur[i]
		lo, hi := max(off, i*m.s), min(off+n, (i+1)*m.s)
		if p == nil {
			clear(sec[lo-i*m.s : hi-i*m.s])
		} else {
			copy(sec[lo-i*m.s:hi-i*m.s], p[lo-off:hi-off])
		}
		m.allowed[i][sha256.Sum256(sec)] = what
		m.dirty[i] = true
	}
}

// durable records that sectors [first, end) now hold their current value for good.
func (m *crashModel) durable(first, end int64) {
	for i := first; i < end; i++ {
		m.allowed[i] = map[[32]byte]string{sha256.Sum256(m.cur[i]): "durable"}
		delete(m.dirty, i)
	}
}

func (m *crashModel) flushed() {
	for i := range m.dirty {
		m.allowed[i] = map[[32]byte]string{sha256.Sum256(m.cur[i]): "flushed"}
	}
	clear(m.dirty)
}

// writer streams requests until one fails (the server was killed) and says how far it got.
func (m *crashModel) writer(c *nbdclient.Client, rng *rand.Rand, auth bool, size int64) string {
	ops, flushes := 0, 0
	s := m.s
	buf := make([]byte, 16*s)
	for {
		ops++
		var err error
		// Half of the writes go to the first 64 sectors, so sectors get many versions.
		span := size
		if rng.IntN(2) == 0 {
			span = min(size, 64*s)
		}
		switch r := rng.IntN(100); {
		case r < 10:
			err = c.Flush()
			if err == nil {
				flushes++
				m.flushed()
			}
		case r < 20: // FUA, whole sectors
			k := 1 + rng.Int64N(4)
			first := rng.Int64N(span/s - k + 1)
			p := buf[:k*s]
			fillRandom(rng, p)
			m.write(first*s, p, k*s, fmt.Sprintf("FUA write #%d", ops))
			if err = c.WriteAt(p, first*s, true); err == nil {
				m.durable(first, first+k)
			}
		case r < 30: // unaligned
			n := 1 + rng.Int64N(3*s)
			off := rng.Int64N(span - n + 1)
			p := buf[:n]
			fillRandom(rng, p)
			m.write(off, p, n, fmt.Sprintf("unaligned write #%d", ops))
			err = c.WriteAt(p, off, false)
		case r < 35:
			n := 1 + rng.Int64N(8*s)
			off := rng.Int64N(span - n + 1)
			m.write(off, nil, n, fmt.Sprintf("write zeroes #%d", ops))
			err = c.WriteZeroes(off, uint32(n))
		case r < 40 && auth: // a trimmed sector reads as zeroes in the authenticated mode
			k := 1 + rng.Int64N(8)
			first := rng.Int64N(span/s - k + 1)
			m.write(first*s, nil, k*s, fmt.Sprintf("trim #%d", ops))
			err = c.Trim(first*s, uint32(k*s))
		default:
			k := 1 + rng.Int64N(16)
			first := rng.Int64N(span/s - k + 1)
			p := buf[:k*s]
			fillRandom(rng, p)
			m.write(first*s, p, k*s, fmt.Sprintf("write #%d", ops))
			err = c.WriteAt(p, first*s, false)
		}
		if err != nil {
			return fmt.Sprintf("%d requests, %d flushes, %d sectors unflushed; stopped by %v", ops, flushes, len(m.dirty), err)
		}
	}
}

func fillRandom(rng *rand.Rand, p []byte) {
	for i := 0; i < len(p); i += 8 {
		v := rng.Uint64()
		for j := 0; j < 8 && i+j < len(p); j++ {
			p[i+j] = byte(v >> (8 * j))
		}
	}
}

// check reads the whole device and compares every sector with the model; then the
// contents read become the model's durable state (they survived the crash and recovery).
// Round 0 only reads: a length-preserving mode's never-written sectors decrypt whatever
// the provider held, so the model starts from what the device reads.
func (m *crashModel) check(t *testing.T, c *nbdclient.Client, round int) {
	t.Helper()
	chunk := make([]byte, 256*m.s)
	bad := 0
	n := int64(len(m.cur))
	for first := int64(0); first < n; first += int64(len(chunk)) / m.s {
		k := min(int64(len(chunk))/m.s, n-first)
		p := chunk[:k*m.s]
		if err := c.ReadAt(p, first*m.s); err != nil {
			t.Fatalf("round %d: read sectors %d..%d after re-attach: %v", round, first, first+k-1, err)
		}
		for j := int64(0); j < k; j++ {
			i := first + j
			sec := p[j*m.s : (j+1)*m.s]
			h := sha256.Sum256(sec)
			if _, ok := m.allowed[i][h]; !ok && round > 0 {
				bad++
				if bad <= 5 {
					var vals []string
					for _, w := range m.allowed[i] {
						vals = append(vals, w)
					}
					t.Errorf("round %d: sector %d (dirty %v, zero %v) holds none of the %d values it may hold: %s",
						round, i, m.dirty[i], bytes.Equal(sec, make([]byte, m.s)), len(vals), strings.Join(vals, ", "))
				}
			}
			copy(m.cur[i], sec)
			m.allowed[i] = map[[32]byte]string{h: fmt.Sprintf("read after round %d", round)}
		}
	}
	clear(m.dirty)
	if bad > 0 {
		t.Fatalf("round %d: %d sectors hold values they may not hold", round, bad)
	}
}

func killSeed(t *testing.T) uint64 {
	if s := os.Getenv("ELI_KILL_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("ELI_KILL_SEED=%q: %v", s, err)
		}
		return v
	}
	return uint64(time.Now().UnixNano())
}

func TestKill9DuringWrites(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	seed := killSeed(t)
	t.Logf("seed %d (ELI_KILL_SEED=%d repeats it)", seed, seed)
	for ci, cfg := range []struct {
		mode   string
		sector int
		size   string
		rounds int
	}{
		{"xchacha20-poly1305", 4096, "16M", 15},
		{"xchacha20-poly1305", 512, "8M", 4},
		{"aes-xts", 4096, "16M", 3},
	} {
		t.Run(fmt.Sprintf("%s/%d", cfg.mode, cfg.sector), func(t *testing.T) {
			t.Parallel()
			rng := rand.New(rand.NewPCG(seed, uint64(ci)))
			e := newEnv(t, true)
			img := e.create(volume{name: "k.img", size: cfg.size, mode: cfg.mode, sector: cfg.sector})
			l := e.dumpLayout(img)
			m := newCrashModel(l.N, l.S)
			for round := 0; round <= cfg.rounds; round++ {
				uri := e.Attach(img)
				if round == 0 {
					c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
					if err != nil {
						t.Fatal(err)
					}
					m.check(t, c, 0)
					c.Close()
					e.detach("k.img")
					continue
				}
				pid := e.Attached("k.img").Pid
				c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
				if err != nil {
					t.Fatal(err)
				}
				wrng := rand.New(rand.NewPCG(seed, uint64(ci)<<32|uint64(round)))
				done := make(chan string, 1)
				go func() { done <- m.writer(c, wrng, l.authenticated(), l.size()) }()
				delay := time.Duration(rng.IntN(700)) * time.Millisecond
				time.Sleep(delay)
				if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
					t.Fatalf("round %d: kill -9 %d: %v", round, pid, err)
				}
				var summary string
				select {
				case summary = <-done:
				case <-time.After(30 * time.Second):
					t.Fatalf("round %d: the writer did not notice the kill", round)
				}
				c.Close()
				e.waitGone(t, "k.img", pid)
				t.Logf("round %d: killed after %v: %s", round, delay, summary)

				uri = e.Attach(img)
				c, err = nbdclient.Dial("unix", elitest.SocketOf(uri), "")
				if err != nil {
					t.Fatal(err)
				}
				m.check(t, c, round)
				c.Close()
				// A real client reads every sector too.
				command(t, time.Minute, "nbdcopy", uri, "null:")
				if !strings.Contains(e.serverLog("k.img"), "attached") {
					t.Fatalf("round %d: server log lacks the attach:\n%s", round, e.serverLog("k.img"))
				}
				e.detach("k.img")
			}
		})
	}
}

// waitGone waits until the killed server of name is gone: `eli list` no longer shows it
// (it takes the name's lock to tell). Waiting for the pid is not enough: the leader of a
// multi-threaded process is a zombie before its last thread has closed the files.
func (e *env) waitGone(t *testing.T, name string, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		found := false
		for _, r := range e.List() {
			found = found || r.Name == name
		}
		if !found {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("server of %s (pid %d) still attached 10 s after SIGKILL", name, pid)
}

package blockdev

import (
	"bytes"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// slowShared is a memory provider standing in for a network export: shared by hosts,
// each write taking a round trip. It records how many writes were in flight at once.
type slowShared struct {
	*memProvider
	mu       sync.Mutex
	inFlight int
	peak     int
}

func (s *slowShared) Capabilities() provider.Capabilities {
	return provider.Capabilities{Shared: true, Punch: s.memProvider.Punch, AtomicWrite: 4096}
}

func (s *slowShared) WriteAt(b []byte, off int64) (int, error) {
	s.mu.Lock()
	s.inFlight++
	s.peak = max(s.peak, s.inFlight)
	s.mu.Unlock()
	time.Sleep(2 * time.Millisecond) // the round trip
	n, err := s.memProvider.WriteAt(b, off)
	s.mu.Lock()
	s.inFlight--
	s.mu.Unlock()
	return n, err
}

// A commit over a shared (network) provider has its data and metadata writes on the
// wire together, rather than one CPU worker's at a time; and what it writes reads back.
func TestCommitConcurrentOverSharedProvider(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 4096)
	p := &slowShared{memProvider: v.mem}
	d, err := Open(p, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(15, 3))
	want := map[int64][]byte{}
	// 32 sectors in 32 different groups (R = 102 records per group for M = 4096).
	for k := range 32 {
		off := int64(k*102+rng.IntN(102)) * 4096
		b := make([]byte, 4096)
		randFill(rng, b)
		if err := d.WriteAt(b, off, 0); err != nil {
			t.Fatal(err)
		}
		want[off] = b
	}
	if err := d.Flush(); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	peak := p.peak
	p.mu.Unlock()
	if peak < 8 {
		t.Fatalf("at most %d writes in flight during a commit of 32 sectors in 32 groups; want them issued together", peak)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d, err = Open(p, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	got := make([]byte, 4096)
	for off, b := range want {
		if err := d.ReadAt(got, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, b) {
			t.Fatalf("sector at %d reads other data after the commit", off)
		}
	}
}

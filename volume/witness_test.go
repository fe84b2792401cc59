package volume

import (
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"
)

// TestWitnessPaced: a stream of flushes does not write the witness file for each one,
// yet the file catches up with the latest without waiting for close, and close writes
// the very latest.
func TestWitnessPaced(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "witness")
	id := [16]byte{1, 2, 3}
	w := newWitness(path, id, slog.New(slog.NewTextHandler(io.Discard, nil)))
	root := func(gen uint64) [32]byte { return [32]byte{byte(gen), byte(gen >> 8)} }

	start := time.Now()
	var gen uint64
	for time.Since(start) < 3*witnessPace {
		gen++
		w.record(gen, root(gen))
		time.Sleep(200 * time.Microsecond)
	}
	elapsed := time.Since(start)
	// Caught up without close: within a pace and a write (5 s: a hang guard).
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		f, err := readWitness(path, id)
		if err != nil {
			t.Fatal(err)
		}
		if f != nil && f.Generation == gen && f.Root == root(gen) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the witness holds %+v five seconds after the last flush, generation %d", f, gen)
		}
	}
	w.mu.Lock()
	writes := w.writes
	w.mu.Unlock()
	if limit := int(elapsed/witnessPace) + 2; writes > limit {
		t.Errorf("%d flushes in %v wrote the witness %d times; paced, at most %d", gen, elapsed, writes, limit)
	}

	gen++
	w.record(gen, root(gen))
	if err := w.close(); err != nil {
		t.Fatal(err)
	}
	if f, err := readWitness(path, id); err != nil || f == nil || f.Generation != gen {
		t.Fatalf("after close the witness holds %+v (%v), want generation %d", f, err, gen)
	}
}

package blockdev

import (
	"bytes"
	"errors"
	"testing"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"
)

// TestAuthFailuresCountTreeRefusals: sectors refused because their metadata block does
// not match the hash tree count as authentication failures (issue 38: 13,056 sectors
// failed and the counter said 0), one per sector the read asked for.
func TestAuthFailuresCountTreeRefusals(t *testing.T) {
	t.Parallel()
	const first, n = 40, 8
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, tamperSectors)
	d := v.open(t)
	if err := d.WriteAt(bytes.Repeat([]byte("count me"), 64*n), first*512, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	clear(rec(v.l, v.mem.data, first+3)) // a zeroed record: the block's digest changes
	d = v.open(t)
	defer d.Close()
	err := d.ReadAt(make([]byte, n*512), first*512)
	if !errors.Is(err, ErrFreshness) {
		t.Fatalf("read over a tampered metadata block: %v, want ErrFreshness", err)
	}
	if got := d.Stats().AuthFailures; got != n {
		t.Fatalf("AuthFailures = %d after %d sectors refused by the tree, want %d", got, n, n)
	}
}

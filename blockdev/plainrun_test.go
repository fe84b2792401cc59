package blockdev

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/elidisk/eli/sector"
)

// sealOnly hides every optional extension of a codec (Runner, MetaRunner), as a codec
// that can only seal sector by sector would have none.
type sealOnly struct{ sector.Codec }

// TestOpenNeedsRuns: blockdev hands every request to the codec as runs of sectors, and
// refuses a codec that cannot take them rather than fall back to a slower path of its own.
func TestOpenNeedsRuns(t *testing.T) {
	t.Parallel()
	for _, mode := range []sector.Mode{sector.ModeXChaCha20Poly1305, sector.ModeChaCha20XTS} {
		v := newTestVol(t, mode, 4096, 64)
		v.cfg.Codec = sealOnly{v.cfg.Codec}
		if _, err := Open(v.mem, v.cfg); err == nil || !strings.Contains(err.Error(), "runs of sectors") {
			t.Errorf("%s without run calls: %v", mode, err)
		}
	}
}

// TestPlainRuns writes and zeroes through the run path of length-preserving writes, for
// modes whose run path differs from their per-sector one (xchacha*-xts batch their
// subkeys), at 512 and 4096-byte sectors and over several pieces and chunks with partial
// sectors at both ends. Every sector on the provider must hold exactly what the codec's
// Seal gives for its index and plaintext, and reads must give the plaintext back.
func TestPlainRuns(t *testing.T) {
	t.Parallel()
	for _, mode := range []sector.Mode{sector.ModeXChaCha20XTS, sector.ModeXChaCha8XTS, sector.ModeChaCha20XTS, sector.ModeAESXTS256} {
		for _, size := range []int{512, 4096} {
			t.Run(fmt.Sprintf("%s/%d", mode, size), func(t *testing.T) {
				t.Parallel()
				testPlainRun(t, mode, size)
			})
		}
	}
}

func testPlainRun(t *testing.T, mode sector.Mode, size int) {
	sectors := uint64((5 << 20) / 2 / size) // 2.5 MiB: more than two 1 MiB pieces
	v := newTestVol(t, mode, size, sectors)
	ref := v.cfg.Codec
	d := v.open(t)
	defer d.Close()
	total := int64(sectors) * int64(size)
	model := make([]byte, total)
	// Zeroes first, so that partial writes start from known plaintext; then a write with
	// partial sectors at both ends, and zeroes over part of it.
	if err := d.WriteZeroes(0, total, 0); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(uint64(mode), uint64(size)))
	off := int64(3*size + 100)
	p := make([]byte, 2<<20+size)
	randFill(r, p)
	if err := d.WriteAt(p, off, 0); err != nil {
		t.Fatal(err)
	}
	copy(model[off:], p)
	zoff, zlen := int64(40*size), int64(70*size+10)
	if err := d.WriteZeroes(zoff, zlen, 0); err != nil {
		t.Fatal(err)
	}
	clear(model[zoff : zoff+zlen])

	raw := v.mem.snapshot()
	want := make([]byte, size)
	for i := range sectors {
		copy(want, model[int64(i)*int64(size):])
		ref.Seal(i, want, nil)
		pos := v.l.DataPos(i)
		if !bytes.Equal(raw[pos:pos+int64(size)], want) {
			t.Fatalf("sector %d on the provider differs from the codec's Seal", i)
		}
	}
	got := make([]byte, total)
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model) {
		t.Fatalf("read back differs from what was written at byte %d", firstDiffAt(got, model))
	}
	part := got[:total-int64(size)-77]
	if err := d.ReadAt(part, 77); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(part, model[77:77+len(part)]) {
		t.Fatal("an unaligned read differs from what was written")
	}
}

func firstDiffAt(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

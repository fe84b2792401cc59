package blockdev

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/elidisk/eli/sector"
)

// sealOnly hides every optional extension of a codec (Runner, SealTo): blockdev then
// seals and opens sector by sector.
type sealOnly struct{ sector.Codec }

// sealToOnly keeps SealTo but hides Runner.
type sealToOnly struct {
	sector.Codec
	st sealerTo
}

func (c sealToOnly) SealTo(index uint64, dst, src, meta []byte) { c.st.SealTo(index, dst, src, meta) }

// TestPlainRuns writes and zeroes through each path that length-preserving writes can
// take (sector.Runner, SealTo, Seal sector by sector), for modes whose run path differs
// from their per-sector one (xchacha*-xts batch their subkeys), at 512 and 4096-byte
// sectors and over several pieces and chunks with partial sectors at both ends. Every
// sector on the provider must hold exactly what the codec's Seal gives for its index and
// plaintext, and reads (OpenRun or Open) must give the plaintext back.
func TestPlainRuns(t *testing.T) {
	t.Parallel()
	paths := []string{"runner", "sealto", "seal"}
	for _, mode := range []sector.Mode{sector.ModeXChaCha20XTS, sector.ModeXChaCha8XTS, sector.ModeChaCha20XTS, sector.ModeAESXTS256} {
		for _, size := range []int{512, 4096} {
			for _, path := range paths {
				t.Run(fmt.Sprintf("%s/%d/%s", mode, size, path), func(t *testing.T) {
					t.Parallel()
					testPlainRun(t, mode, size, path)
				})
			}
		}
	}
}

func testPlainRun(t *testing.T, mode sector.Mode, size int, path string) {
	sectors := uint64((5 << 20) / 2 / size) // 2.5 MiB: more than two 1 MiB pieces
	v := newTestVol(t, mode, size, sectors)
	ref := v.cfg.Codec
	switch path {
	case "runner":
		if _, ok := ref.(sector.Runner); !ok {
			t.Fatalf("%s has no Runner", mode)
		}
	case "sealto":
		st, ok := ref.(sealerTo)
		if !ok {
			t.Fatalf("%s has no SealTo", mode)
		}
		v.cfg.Codec = sealToOnly{ref, st}
	case "seal":
		v.cfg.Codec = sealOnly{ref}
	}
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

package blockdev

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// FuzzProviderBytes: whatever bytes the provider of a volume holds, the device serves
// data or an I/O error, never something else, and never panics. In format version 2 the
// data is the current data; in version 1, which keeps no generation, it may also be a
// value the sector held earlier (docs/threat-model.md). The fuzzer changes a volume's
// provider behind the device's back: flipped bytes, zeroed runs, runs put back from an
// older image of the same volume, blocks copied from elsewhere on the provider. The volume
// is left cleanly closed, or by a crash in the middle of a commit (its journal then has
// something to replay). In version 2, Open gets the generation the untouched image
// recovers to as MinGeneration, as a witness would give it.
//
// Then, on the changed provider:
//   - Open, read-only and then writable, fails with an error, or every sector reads its
//     true value (or in version 1 an earlier one) or fails with EIO;
//   - a write that succeeded, with the flush after it, reads back;
//   - after Close, a reopen fails, or every sector reads its newest value (version 1: or
//     an earlier one) or fails with EIO, and the sectors written and flushed read back.
//
// The seed corpus runs in every test run; `go test -fuzz FuzzProviderBytes ./blockdev/`
// searches further.
func FuzzProviderBytes(f *testing.F) {
	bases := append(providerFuzzBases(f, layout.Version2), providerFuzzBases(f, layout.Version1)...)
	// Seeds: one change in each kind of region, for each base.
	for b := range bases {
		l := bases[b].v.l
		targets := []int64{
			l.JournalOffset() + 100,
			l.JournalOffset() + l.JournalSlotLen() + 8,
			l.BlockPos(0) + 5,
			l.BlockPos(1) + int64(l.MetaBlockSize()) - 3,
			l.DataPos(3) + 17,
			l.DataPos(fuzzSectors - 20), // in the last round of the crashed bases
			l.DataPos(l.Sectors-1) + 511,
		}
		if l.Version >= layout.Version2 {
			targets = append(targets, l.NodePos(1, 0)+40, l.NodePos(2, 0)+1)
		}
		f.Add([]byte{byte(b)})
		for op := range byte(4) {
			for _, off := range targets {
				f.Add(fuzzOp(byte(b), op, off, 0x41))
			}
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		base := &bases[int(data[0])%len(bases)]
		img := bytes.Clone(base.img)
		for ops := data[1:]; len(ops) >= 6; ops = ops[6:] {
			if len(data)-len(ops) > 1+6*16 {
				break // at most 16 changes
			}
			mutateProvider(img, base.older, ops[0], int64(binary.LittleEndian.Uint32(ops[1:5])), ops[5])
		}
		base.check(t, img, data[0])
	})
}

// fuzzOp is one FuzzProviderBytes input: base b with one change.
func fuzzOp(b, op byte, off int64, arg byte) []byte {
	in := []byte{b, op, 0, 0, 0, 0, arg}
	binary.LittleEndian.PutUint32(in[2:6], uint32(off))
	return in
}

// mutateProvider applies one change to img: op picks what, at offset off (taken modulo
// the image), with arg giving the byte or the length.
func mutateProvider(img, older []byte, op byte, off int64, arg byte) {
	size := int64(len(img))
	off %= size
	n := min(int64(arg)*16+16, size-off)
	switch op % 4 {
	case 0: // flip bits of one byte
		img[off] ^= arg | 1
	case 1: // zero a run
		clear(img[off : off+n])
	case 2: // put back a run from the older image
		copy(img[off:off+n], older[off:off+n])
	case 3: // copy an aligned 512-byte block over another
		src := (off * 7919) % size &^ 511
		dst := off &^ 511
		if src+512 <= size && dst+512 <= size {
			copy(img[dst:dst+512], img[src:src+512])
		}
	}
}

// providerFuzzBase is an image to change and what it holds.
type providerFuzzBase struct {
	v     *testVol
	img   []byte
	older []byte   // an earlier image of the same volume
	truth [][]byte // sector i's value, as the untouched image reads
	gen   uint64   // the generation the untouched image opens at
	dir   string   // in tmpfs, for the changed images
	// earlier holds, in format version 1, the values any sector held before its truth
	// (indexed by sector, then version); nil in version 2, which serves only the truth.
	earlier [][][]byte
}

var fuzzFileSeq atomic.Uint64

const fuzzSectors = 102 * 20 // 20 groups under one tree node of each level

func providerFuzzBases(f testing.TB, version uint32) []providerFuzzBase {
	f.Helper()
	v := newTestVolVersion(f, version, sector.ModeXChaCha20Poly1305, 512, fuzzSectors)
	v.cfg.Logger = discardLogger()
	s := v.l.SectorSize
	pattern := func(tag byte) []byte {
		p := make([]byte, fuzzSectors*s)
		for i := range p {
			p[i] = byte(i/s) ^ byte(i/s>>8) ^ byte(i) ^ tag
		}
		return p
	}
	write := func(d *Device, p []byte, groups ...uint64) {
		for _, g := range groups {
			lo, hi := g*102*uint64(s), (g+1)*102*uint64(s)
			if err := d.WriteAt(p[lo:hi], int64(lo), 0); err != nil {
				f.Fatal(err)
			}
		}
	}
	d := v.open(f)
	write(d, pattern(0x11), rangeN(20)...)
	if err := d.Close(); err != nil {
		f.Fatal(err)
	}
	first := v.mem.snapshot()

	// Clean: groups rewritten, then closed.
	d = v.open(f)
	write(d, pattern(0x22), 0, 5, 6, 19)
	if err := d.Close(); err != nil {
		f.Fatal(err)
	}
	bases := []providerFuzzBase{{img: v.mem.snapshot()}}

	// Crashed: two commits after the clean image; the crash falls in the second one
	// (after its journal slot reached the provider, before or while its blocks did), or
	// just before or after the flush that waited for it returned.
	rec := newRecorder(first)
	d, err := Open(rec, v.cfg)
	if err != nil {
		f.Fatal(err)
	}
	write(d, pattern(0x33), 1, 2, 12)
	if err := d.Flush(); err != nil {
		f.Fatal(err)
	}
	mid := rec.numEvents()
	write(d, pattern(0x44), 2, 3, 13, 19)
	if err := d.Flush(); err != nil {
		f.Fatal(err)
	}
	end := rec.numEvents()
	rng := rand.New(rand.NewPCG(7, 7))
	for _, c := range []int{mid + (end-mid)/2, end - 3, end - 1, end} {
		img, _ := rec.crashImage(c, 512, rng)
		bases = append(bases, providerFuzzBase{img: img})
	}
	d.Close()

	dir, err := tempDirIn(f, "/dev/shm")
	if err != nil {
		f.Fatalf("a tmpfs for the mapped provider: %v", err)
	}
	for k := range bases {
		b := &bases[k]
		b.v, b.older, b.dir = v, first, dir
		if version == layout.Version1 {
			// Zeroes (a zeroed record reads as never written) and every pattern,
			// whichever sectors it went to: a sector never holds another sector's
			// value, so this is hardly looser than each one's own history.
			b.earlier = make([][][]byte, fuzzSectors)
			for i := range b.earlier {
				b.earlier[i] = [][]byte{make([]byte, s)}
			}
			for _, tag := range []byte{0x11, 0x22, 0x33, 0x44} {
				p := pattern(tag)
				for i := range b.earlier {
					b.earlier[i] = append(b.earlier[i], p[i*s:(i+1)*s])
				}
			}
		}
		d, err := Open(&memProvider{data: bytes.Clone(b.img)}, v.cfg)
		if err != nil {
			f.Fatalf("base %d: %v", k, err)
		}
		fr, _ := d.Freshness()
		b.gen = fr.Generation
		b.truth = make([][]byte, fuzzSectors)
		for i := range b.truth {
			b.truth[i] = make([]byte, s)
			if err := d.ReadAt(b.truth[i], int64(i*s)); err != nil {
				f.Fatalf("base %d: sector %d: %v", k, i, err)
			}
		}
		d.Close()
	}
	return bases
}

func rangeN(n uint64) []uint64 {
	r := make([]uint64, n)
	for i := range r {
		r[i] = uint64(i)
	}
	return r
}

// check opens the changed image img and asserts FuzzProviderBytes' properties.
func (b *providerFuzzBase) check(t *testing.T, img []byte, tag byte) {
	cfg := b.v.cfg
	cfg.MinGeneration = b.gen
	var gen uint64
	cfg.OnFlushed = func(g uint64, _ [32]byte) { gen = g }
	want := slices.Clone(b.truth)
	alt := make([][]byte, len(want)) // a second value a sector may read

	// Read-only first: recovery in memory, nothing written.
	ro := cfg
	ro.ReadOnly = true
	if d, err := Open(&memProvider{data: img}, ro); err == nil {
		checkSectors(t, "opened read-only", d, want, alt, b.earlier, nil)
		d.Close()
	}

	// Then writable, on a file in tmpfs as eli attaches it: read through a mapping,
	// metadata loaded by pread and written through the mapping.
	path := filepath.Join(b.dir, fmt.Sprintf("img-%d", fuzzFileSeq.Add(1)))
	if err := os.WriteFile(path, img, 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)
	f, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d, err := Open(f, cfg)
	if err != nil {
		return // refused: nothing served
	}
	checkSectors(t, "opened", d, want, alt, b.earlier, nil)

	// Writes over a few sectors spread over the groups; those that succeed, with the
	// flush after them, must read back now and after a reopen.
	s := b.v.l.SectorSize
	written := map[int]bool{}
	for k, i := range []int{0, 101, 102, 700, 1000, fuzzSectors - 1} {
		p := bytes.Repeat([]byte{tag ^ byte(k) ^ 0xa5}, s)
		write := d.WriteAt
		if k%2 == 1 { // the NBD server's way: the buffer is kept and sealed in place
			write = func(p []byte, off int64, f Flags) error {
				return d.WriteKeep(bytes.Clone(p), off, f, func() {})
			}
		}
		if write(p, int64(i*s), 0) == nil {
			want[i], alt[i] = p, want[i]
			written[i] = true
		}
	}
	if d.Flush() != nil {
		written = nil // durable or not: the old value may read too
	} else {
		clear(alt)
	}
	checkSectors(t, "written", d, want, alt, b.earlier, written)
	if d.Close() != nil {
		return
	}
	cfg.MinGeneration, cfg.OnFlushed = gen, nil
	d, err = Open(f, cfg)
	if err != nil {
		t.Fatalf("the first open and the close succeeded, the reopen fails: %v", err)
	}
	checkSectors(t, "reopened", d, want, alt, b.earlier, written)
	d.Close()
}

// checkSectors asserts that every sector i of d reads want[i] or alt[i] (when not nil), or
// one of earlier[i] (when earlier is not nil) unless i is in written, or fails with EIO;
// the sectors in written must not fail.
func checkSectors(t *testing.T, when string, d *Device, want, alt [][]byte, earlier [][][]byte, written map[int]bool) {
	t.Helper()
	s := d.SectorSize()
	got := make([]byte, s)
	for i := range want {
		err := d.ReadAt(got, int64(i*s))
		switch {
		case err != nil:
			if !errors.Is(err, syscall.EIO) {
				t.Fatalf("%s: sector %d: error %v does not wrap EIO", when, i, err)
			}
			if written[i] {
				t.Fatalf("%s: sector %d was written and flushed but fails: %v", when, i, err)
			}
		case bytes.Equal(got, want[i]), alt[i] != nil && bytes.Equal(got, alt[i]):
		case earlier != nil && !written[i] && slices.ContainsFunc(earlier[i], func(e []byte) bool { return bytes.Equal(got, e) }):
		default:
			t.Fatalf("%s: sector %d reads a value it does not hold", when, i)
		}
	}
}

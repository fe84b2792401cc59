package blockdev

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"

	"golang.org/x/crypto/chacha20poly1305"
)

// freshVols are the two states of one format version 2 volume of 512-byte sectors over
// 130 groups (level-1 nodes 0 and 1 under level-2 node 0, then single nodes up to the top
// at level 7): old, with
// every sector written, and cur, after every sector of groups 0 to 2 and 127 to 129 was
// written again. Attacks take pieces of old and put them into cur.
type freshVols struct {
	v        *testVol
	old, cur []byte
	oldPlain []byte
	newPlain []byte
}

const freshSectors = 102 * 130

func newFreshVols(t *testing.T) *freshVols {
	t.Helper()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, freshSectors)
	f := &freshVols{v: v}
	f.oldPlain = make([]byte, freshSectors*512)
	for i := range f.oldPlain {
		f.oldPlain[i] = byte(i/512) ^ byte(i) ^ 0x5a
	}
	d := v.open(t)
	if err := d.WriteAt(f.oldPlain, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	f.old = v.mem.snapshot()
	f.newPlain = bytes.Clone(f.oldPlain)
	d = v.open(t)
	for _, g := range []uint64{0, 1, 2, 127, 128, 129} {
		p := f.newPlain[g*102*512 : (g+1)*102*512]
		for k := range p {
			p[k] ^= 0xff
		}
		if err := d.WriteAt(p, int64(g*102*512), 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	f.cur = v.mem.snapshot()
	return f
}

// open opens a copy of img.
func (f *freshVols) open(img []byte) (*Device, error) {
	cfg := f.v.cfg
	cfg.Logger = discardLogger()
	return Open(&memProvider{data: bytes.Clone(img)}, cfg)
}

// TestFreshnessAttacks: each attack from issue 14 on a version 2 volume ends in EIO for the
// sectors concerned (ErrFreshness: the groups whose metadata no longer matches the tree)
// or a refused Open, never in old data or zeroes served as current; every other sector
// still reads its current value.
func TestFreshnessAttacks(t *testing.T) {
	t.Parallel()
	f := newFreshVols(t)
	l := f.v.l
	block := func(img []byte, g uint64) []byte {
		p := l.BlockPos(g)
		return img[p : p+int64(l.MetaBlockSize())]
	}
	node := func(img []byte, level int, k uint64) []byte {
		p := l.NodePos(level, k)
		return img[p : p+layout.NodeSize]
	}
	groupsOf := func(lo, hi uint64) []uint64 {
		var gs []uint64
		for g := lo; g < hi; g++ {
			gs = append(gs, g)
		}
		return gs
	}
	const i = 1*102 + 7 // a sector of group 1, rewritten between old and cur
	cases := []struct {
		name    string
		tamper  func(img []byte)
		refused bool     // Open must fail
		groups  []uint64 // groups whose sectors must fail to read
	}{
		{"replay one sector's data and record", func(img []byte) {
			copy(data(l, img, i), data(l, f.old, i))
			copy(rec(l, img, i), rec(l, f.old, i))
		}, false, []uint64{1}},
		{"replay one sector's data and its metadata block", func(img []byte) {
			copy(data(l, img, i), data(l, f.old, i))
			copy(block(img, 1), block(f.old, 1))
		}, false, []uint64{1}},
		{"zero a record", func(img []byte) { clear(rec(l, img, i)) }, false, []uint64{1}},
		{"zero a record never rewritten", func(img []byte) { clear(rec(l, img, 50*102+3)) }, false, []uint64{50}},
		{"zero a metadata block", func(img []byte) { clear(block(img, 1)) }, false, []uint64{1}},
		{"zero a level-1 node", func(img []byte) { clear(node(img, 1, 0)) }, false, groupsOf(0, 128)},
		{"replay a level-1 node with its blocks", func(img []byte) {
			copy(node(img, 1, 1), node(f.old, 1, 1))
			copy(block(img, 128), block(f.old, 128))
		}, false, groupsOf(128, 130)},
		{"zero a level-2 node", func(img []byte) { clear(node(img, 2, 0)) }, false, groupsOf(0, 130)},
		{"replay a level-2 node", func(img []byte) { copy(node(img, 2, 0), node(f.old, 2, 0)) }, false, groupsOf(0, 130)},
		{"zero the top node", func(img []byte) { clear(node(img, layout.TreeDepth, 0)) }, true, nil},
		{"replay the top node", func(img []byte) { copy(node(img, layout.TreeDepth, 0), node(f.old, layout.TreeDepth, 0)) }, true, nil},
		{"replay the journal", func(img []byte) {
			copy(img[l.JournalOffset():l.DataOffset], f.old[l.JournalOffset():l.DataOffset])
		}, true, nil},
		{"zero the journal", func(img []byte) { clear(img[l.JournalOffset():l.DataOffset]) }, true, nil},
		{"damage the newest journal slot", func(img []byte) {
			// The newest slot is Close's, with no entries and the root of the last round,
			// which the previous slot also holds: that one opens, matches, and every sector
			// reads its current value (one generation lower: a witness would refuse it).
			fr, _, _ := PeekFreshness(&memProvider{data: img}, l)
			img[l.JournalSlotOffset(int(fr.Generation%2))+journal2HeaderLen+3] ^= 1
		}, false, nil},
		{"put back the older journal slot over the newest", func(img []byte) {
			fr, _, _ := PeekFreshness(&memProvider{data: img}, l)
			newest, other := l.JournalSlotOffset(int(fr.Generation%2)), l.JournalSlotOffset(int(1-fr.Generation%2))
			copy(img[newest:newest+l.JournalSlotLen()], img[other:other+l.JournalSlotLen()])
		}, true, nil},
		{"replay the journal and the tree", func(img []byte) {
			copy(img[l.JournalOffset():l.DataOffset], f.old[l.JournalOffset():l.DataOffset])
			for level := 1; level <= layout.TreeDepth; level++ {
				copy(node(img, level, 0), node(f.old, level, 0))
			}
			copy(node(img, 1, 1), node(f.old, 1, 1))
		}, false, []uint64{0, 1, 2, 127, 128, 129}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			img := bytes.Clone(f.cur)
			tc.tamper(img)
			d, err := f.open(img)
			if tc.refused {
				if err == nil {
					d.Close()
					t.Fatal("Open accepted the tampered provider")
				}
				if !errors.Is(err, ErrFreshness) || !errors.Is(err, syscall.EIO) {
					t.Fatalf("Open: %v, want ErrFreshness", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			defer d.Close()
			bad := map[uint64]bool{}
			for _, g := range tc.groups {
				bad[g] = true
			}
			var logged atomic.Int64
			authOf(d).log = slog.New(countHandler{"does not match the hash tree", &logged})
			buf := make([]byte, 512)
			for k := uint64(0); k < freshSectors; k++ {
				err := d.ReadAt(buf, int64(k)*512)
				g := k / 102
				if bad[g] {
					if !errors.Is(err, ErrFreshness) || !errors.Is(err, syscall.EIO) {
						t.Fatalf("sector %d of tampered group %d: %v, want ErrFreshness", k, g, err)
					}
					continue
				}
				if err != nil || !bytes.Equal(buf, f.newPlain[k*512:(k+1)*512]) {
					t.Fatalf("untouched sector %d (group %d): %v", k, g, err)
				}
			}
			// Each failing group is logged once, however many of its sectors were read.
			if got := logged.Load(); got != int64(len(tc.groups)) {
				t.Errorf("%d log lines for %d failing groups", got, len(tc.groups))
			}
		})
	}
}

// TestFreshnessWholeRollback: a whole provider put back reads as its older self (nothing
// on it is inconsistent) unless Open is given the generation a witness recorded, which
// refuses it naming both generations; a provider newer than the witness opens.
func TestFreshnessWholeRollback(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 4096, 500)
	var gens []uint64
	var roots [][32]byte
	v.cfg.OnFlushed = func(gen uint64, root [32]byte) {
		gens = append(gens, gen)
		roots = append(roots, root)
	}
	d := v.open(t)
	if f, ok := d.Freshness(); !ok || f.Generation != 0 || f.Root != ([32]byte{}) {
		t.Fatalf("fresh volume: freshness %+v %v, want generation 0 and the zero root", f, ok)
	}
	var images [][]byte
	for k := range 3 {
		if err := d.WriteAt(bytes.Repeat([]byte{byte(k + 1)}, 8192), int64(k)*4096*150, 0); err != nil {
			t.Fatal(err)
		}
		if err := d.Flush(); err != nil {
			t.Fatal(err)
		}
		images = append(images, v.mem.snapshot())
	}
	f, _ := d.Freshness()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if len(gens) != 4 || gens[2] != f.Generation || roots[2] != f.Root || gens[3] <= gens[2] {
		t.Fatalf("OnFlushed reported generations %v; Freshness said %d", gens, f.Generation)
	}
	for k := 1; k < len(gens); k++ {
		if gens[k] <= gens[k-1] {
			t.Fatalf("generations %v do not grow", gens)
		}
	}
	v.cfg.OnFlushed = nil
	for k, img := range images {
		cfg := v.cfg
		cfg.Logger = discardLogger()
		// The witness is at the last flush before the close.
		cfg.MinGeneration = gens[2]
		d, err := Open(&memProvider{data: bytes.Clone(img)}, cfg)
		if k < 2 {
			if !errors.Is(err, ErrRolledBack) {
				t.Fatalf("image of flush %d, witness at %d: %v, want ErrRolledBack", k, gens[2], err)
			}
			if want := fmt.Sprintf("generation %d, its witness at %d", gens[k], gens[2]); !bytes.Contains([]byte(err.Error()), []byte(want)) {
				t.Errorf("error %q does not say %q", err, want)
			}
			// Without a witness it opens, as its older self.
			cfg.MinGeneration = 0
			if d, err = Open(&memProvider{data: bytes.Clone(img)}, cfg); err != nil {
				t.Fatalf("image of flush %d without a witness: %v", k, err)
			}
			d.Close()
			continue
		}
		if err != nil {
			t.Fatalf("image of the witnessed flush: %v", err)
		}
		d.Close()
	}
	// After the close (one generation newer than the witness): accepted.
	cfg := v.cfg
	cfg.MinGeneration = gens[2]
	d, err := Open(v.mem, cfg)
	if err != nil {
		t.Fatalf("provider newer than its witness: %v", err)
	}
	if f, _ := d.Freshness(); f.Generation != gens[3] {
		t.Errorf("reopened at generation %d, closed at %d", f.Generation, gens[3])
	}
	d.Close()
}

// TestTamperUndetectableV1DetectedV2: the cases of TestTamperUndetectable, which version 1
// cannot see, fail with ErrFreshness in version 2, and the read-only attach of a journal
// left by a crash keeps verifying against the recovered tree.
func TestTamperUndetectableV1DetectedV2(t *testing.T) {
	t.Parallel()
	const i = 42
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, tamperSectors)
	oldPlain := bytes.Repeat([]byte("old!"), 128)
	newPlain := bytes.Repeat([]byte("new!"), 128)
	d := v.open(t)
	if err := d.WriteAt(oldPlain, i*512, FUA); err != nil {
		t.Fatal(err)
	}
	oldData := bytes.Clone(data(v.l, v.mem.data, i))
	oldRec := bytes.Clone(rec(v.l, v.mem.data, i))
	if err := d.WriteAt(newPlain, i*512, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	good := v.mem.snapshot()
	buf := make([]byte, 512)
	for _, tc := range []struct {
		name   string
		tamper func(raw []byte)
	}{
		{"replay", func(raw []byte) {
			copy(data(v.l, raw, i), oldData)
			copy(rec(v.l, raw, i), oldRec)
		}},
		{"zeroed record", func(raw []byte) { clear(rec(v.l, raw, i)) }},
	} {
		v.mem.data = bytes.Clone(good)
		tc.tamper(v.mem.data)
		d := v.open(t)
		err := d.ReadAt(buf, i*512)
		if !errors.Is(err, ErrFreshness) {
			t.Errorf("%s: %v (read %q...), want ErrFreshness", tc.name, err, buf[:8])
		}
		d.Close()
	}
}

// TestFreshnessReadOnlyRecovery: a read-only attach after a crash mid-commit applies the
// journal in memory; blocks loaded later (the cache is one block) still verify, with the
// recovered records, and the provider is not written.
func TestFreshnessReadOnlyRecovery(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, 1000)
	rec0 := newRecorder(v.mem.data)
	d, err := Open(rec0, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	plain := make([]byte, 1000*512)
	for k := range plain {
		plain[k] = byte(k*7 + k/512)
	}
	if err := d.WriteAt(plain, 0, FUA); err != nil {
		t.Fatal(err)
	}
	before := rec0.numEvents()
	for _, s := range []int64{5, 300, 700} {
		copy(plain[s*512:], bytes.Repeat([]byte{0xee}, 512))
		if err := d.WriteAt(plain[s*512:(s+1)*512], s*512, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Flush(); err != nil {
		t.Fatal(err)
	}
	d.Close()
	// Crash after the journal and the data of the second commit: its blocks and nodes
	// never reached the provider.
	img := bytes.Clone(rec0.base)
	for _, e := range rec0.events[:before+2+3] {
		apply(img, e, e.off, e.off+e.size())
	}
	cfg := v.cfg
	cfg.ReadOnly = true
	cfg.CacheBytes = 4096
	p := &memProvider{data: bytes.Clone(img)}
	d2, err := Open(p, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if r := d2.Recovery(); r.Journal != "replayed" || !r.InMemory || r.RolledForward != 3 {
		t.Fatalf("recovery %+v, want 3 rolled forward in memory", r)
	}
	got := make([]byte, len(plain))
	for pass := range 2 { // the second pass reloads every block
		if err := d2.ReadAt(got, 0); err != nil {
			t.Fatalf("pass %d: %v", pass, err)
		}
		if !bytes.Equal(got, plain) {
			t.Fatalf("pass %d: read-only recovery reads other data", pass)
		}
	}
	if !bytes.Equal(p.data, img) {
		t.Error("a read-only attach wrote the provider")
	}
}

// TestFreshnessGrow: a version 2 volume grown as `eli resize` grows it (the provider
// extended, the area past the old data area zero, the header's sector count raised) keeps
// its root and generation, reads its data, reads the new sectors as zeroes, and takes
// writes there, across a level-1 node that did not exist before.
func TestFreshnessGrow(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, 102*100)
	d := v.open(t)
	plain := make([]byte, 102*100*512)
	for k := range plain {
		plain[k] = byte(k ^ k>>9)
	}
	if err := d.WriteAt(plain, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	f0, _, _ := PeekFreshness(v.mem, v.l)
	grown, size := layoutForVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, 102*300, layout.Align)
	if grown.DataOffset != v.l.DataOffset {
		t.Fatal("layouts differ")
	}
	mem := newMem(size)
	copy(mem.data, v.mem.data[:v.l.End()])
	cfg := v.cfg
	cfg.Layout = grown
	cfg.MinGeneration = f0.Generation
	d, err := Open(mem, cfg)
	if err != nil {
		t.Fatalf("open grown: %v", err)
	}
	if f, _ := d.Freshness(); f != f0 {
		t.Errorf("grown volume freshness %+v, was %+v", f, f0)
	}
	got := make([]byte, d.Size())
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:len(plain)], plain) || !bytes.Equal(got[len(plain):], make([]byte, len(got)-len(plain))) {
		t.Fatal("grown volume reads other data")
	}
	tail := bytes.Repeat([]byte("grown"), 40000)
	if err := d.WriteAt(tail, int64(len(plain))-1000, FUA); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d = func() *Device {
		d, err := Open(mem, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}()
	defer d.Close()
	back := make([]byte, len(tail))
	if err := d.ReadAt(back, int64(len(plain))-1000); err != nil || !bytes.Equal(back, tail) {
		t.Fatalf("write across the old end: %v", err)
	}
}

// TestOnFlushedConcurrent: flushes from many goroutines report generations that only grow,
// one call at a time, and each Flush returns after a report at least as new as its data.
func TestOnFlushedConcurrent(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 4096, 2000)
	var mu sync.Mutex
	var last uint64
	inCall := false
	v.cfg.OnFlushed = func(gen uint64, _ [32]byte) {
		mu.Lock()
		if inCall {
			t.Error("OnFlushed calls overlap")
		}
		if gen <= last {
			t.Errorf("generation %d reported after %d", gen, last)
		}
		last, inCall = gen, true
		mu.Unlock()
		mu.Lock()
		inCall = false
		mu.Unlock()
	}
	d := v.open(t)
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() {
			buf := bytes.Repeat([]byte{byte(c)}, 4096)
			for k := range 40 {
				if err := d.WriteAt(buf, int64(c*200+k)*4096, 0); err != nil {
					t.Error(err)
					return
				}
				if err := d.Flush(); err != nil {
					t.Error(err)
					return
				}
				f, _ := d.Freshness()
				mu.Lock()
				if last < f.Generation && f.Generation > 0 && last == 0 {
					t.Errorf("flush returned before any report")
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	f, _, _ := PeekFreshness(v.mem, v.l)
	if last != f.Generation {
		t.Errorf("last report %d, provider at %d", last, f.Generation)
	}
}

// TestFreshnessWriteToTamperedGroup: a write to a group whose metadata block no longer
// matches the tree cannot be committed (rewriting the block would seal what was changed
// into the tree): the Flush fails with ErrFreshness and the device takes no more writes,
// while reads of other groups go on; after reattaching, the group still fails and the
// others still read.
func TestFreshnessWriteToTamperedGroup(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, 102*4)
	d := v.open(t)
	plain := bytes.Repeat([]byte{0x3c}, 102*4*512)
	if err := d.WriteAt(plain, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	rec(v.l, v.mem.data, 102+3)[5] ^= 1
	v.cfg.Logger = discardLogger()
	d = v.open(t)
	if err := d.WriteAt(make([]byte, 512), 102*512, 0); err != nil {
		t.Fatal(err) // accepted into the batch; the commit finds the damage
	}
	if err := d.Flush(); !errors.Is(err, ErrFreshness) {
		t.Fatalf("flush of a write to a tampered group: %v, want ErrFreshness", err)
	}
	buf := make([]byte, 512)
	if err := d.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, plain[:512]) {
		t.Fatalf("read of another group after the failed commit: %v", err)
	}
	d.Close()
	d = v.open(t)
	defer d.Close()
	if err := d.ReadAt(buf, 102*512); !errors.Is(err, ErrFreshness) {
		t.Fatalf("tampered group after reattach: %v", err)
	}
	if err := d.ReadAt(buf, 3*102*512); err != nil || !bytes.Equal(buf, plain[:512]) {
		t.Fatalf("another group after reattach: %v", err)
	}
}

// TestFreshnessDamagedNewestSlot: on a provider left after a flush (no clean close), the
// newest journal slot holds the last round; with it damaged, the previous slot looks
// current, but the tree on disk is newer than that slot's root: Open is refused.
//
// The last round here is committed by the committer alone, with no Flush waiting: FUA
// writes and flushes are each followed by an empty slot (markCompleted), which carries
// the round's root.
func TestFreshnessDamagedNewestSlot(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 4096, 500)
	v.cfg.CommitInterval = time.Millisecond
	d := v.open(t)
	for k := range 3 {
		if err := d.WriteAt(bytes.Repeat([]byte{byte(k + 1)}, 4096), int64(k)*4096*150, FUA); err != nil {
			t.Fatal(err)
		}
	}
	commits := d.Stats().Commits
	if err := d.WriteAt(bytes.Repeat([]byte{4}, 4096), 4096*450, 0); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); d.Stats().Commits == commits; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the last write was not committed within 10 s")
		}
	}
	img := v.mem.snapshot()
	d.Close()
	// Three rounds each followed by an empty slot, then the last round.
	fr, ok, err := PeekFreshness(&memProvider{data: img}, v.l)
	if err != nil || !ok || fr.Generation != 7 {
		t.Fatalf("freshness %+v %v %v, want generation 7", fr, ok, err)
	}
	img[v.l.JournalSlotOffset(int(fr.Generation%2))+journal2HeaderLen+3] ^= 1
	cfg := v.cfg
	cfg.Logger = discardLogger()
	if d, err := Open(&memProvider{data: img}, cfg); !errors.Is(err, ErrFreshness) {
		if err == nil {
			d.Close()
		}
		t.Fatalf("Open with the newest slot damaged: %v, want ErrFreshness", err)
	}
}

// TestMinGenerationVersion1: a minimum generation for a version 1 volume, which has none,
// refuses the attach rather than being ignored.
func TestMinGenerationVersion1(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 300)
	if v.l.Tree() {
		t.Skip("ELI_TEST_FORMAT2 makes every volume version 2")
	}
	v.cfg.MinGeneration = 1
	if d, err := Open(v.mem, v.cfg); err == nil {
		d.Close()
		t.Fatal("Open of a version 1 volume accepted a minimum generation")
	}
}

// TestFreshnessLastRoundAfterCrash: a server stops without closing right after a flush
// (a crash, kill -9), so its journal still names the last round's sectors with their old
// and new records. Putting back the old ciphertext of those sectors must not make
// recovery take the old records: with the witness of that flush, the attach succeeds and
// every such sector fails to read, as any sector whose ciphertext was changed does.
func TestFreshnessLastRoundAfterCrash(t *testing.T) {
	t.Parallel()
	const s = 512
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, s, 4*102)
	var witness uint64
	v.cfg.OnFlushed = func(gen uint64, _ [32]byte) { witness = gen }
	oldPlain := bytes.Repeat([]byte{0x01}, 4*102*s)
	newPlain := bytes.Repeat([]byte{0x02}, 10*s)
	d := v.open(t)
	if err := d.WriteAt(oldPlain, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Flush(); err != nil {
		t.Fatal(err)
	}
	before := v.mem.snapshot()
	const first = 150 // sectors 150 to 159, in group 1
	if err := d.WriteAt(newPlain, first*s, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Flush(); err != nil {
		t.Fatal(err)
	}
	crashed, witnessed := v.mem.snapshot(), witness // the server dies here
	d.Close()

	img := bytes.Clone(crashed)
	for i := uint64(first); i < first+10; i++ {
		pos := v.l.DataPos(i)
		copy(img[pos:pos+s], before[pos:pos+s])
	}
	cfg := v.cfg
	cfg.OnFlushed, cfg.MinGeneration, cfg.Logger = nil, witnessed, discardLogger()
	d, err := Open(&memProvider{data: img}, cfg)
	if err != nil {
		t.Fatalf("attach at the witnessed generation: %v", err)
	}
	defer d.Close()
	got := make([]byte, s)
	for i := int64(first); i < first+10; i++ {
		err := d.ReadAt(got, i*s)
		if err == nil {
			t.Fatalf("sector %d, whose old ciphertext was put back after a crash, reads %x..., want an I/O error", i, got[:4])
		}
		if !errors.Is(err, syscall.EIO) {
			t.Fatalf("sector %d: %v, want EIO", i, err)
		}
	}
	if err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, oldPlain[:s]) {
		t.Fatalf("sector 0, untouched: %v", err)
	}
}

// TestFlushAckSurvivesDataRollback: whenever a Flush returns, what it acknowledged must
// survive a crash at that instant followed by any older ciphertext put back over the data
// area. One goroutine writes versions of random sectors, another flushes; at each
// Flush's return the test notes the recorder's position, the generation reported to the
// witness, and the version of every sector when the Flush was called. Each crash image
// there, with the data area of every earlier image put back over it in turn, must open
// with the witness's generation, and each sector must read that version, a later one, or
// EIO: never an older one.
func TestFlushAckSurvivesDataRollback(t *testing.T) {
	t.Parallel()
	const s, n = 512, 4 * 102
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, s, n)
	var mu sync.Mutex
	var witness uint64
	cfg := v.cfg
	cfg.Logger = discardLogger()
	cfg.CommitInterval = time.Millisecond
	cfg.OnFlushed = func(gen uint64, _ [32]byte) { mu.Lock(); witness = gen; mu.Unlock() }
	rec := newRecorder(v.mem.snapshot())
	d, err := Open(rec, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stamp := func(i, ver uint64) []byte {
		b := bytes.Repeat([]byte{byte(i*31 + ver)}, s)
		binary.LittleEndian.PutUint64(b, i)
		binary.LittleEndian.PutUint64(b[8:], ver)
		return b
	}
	versions := make([]uint64, n) // the newest completed write of each sector (0: never)
	stop := make(chan struct{})
	wrote := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(1, 2))
		for ver := uint64(1); ; ver++ {
			select {
			case <-stop:
				wrote <- nil
				return
			default:
			}
			first, k := rng.Uint64N(n), 1+rng.IntN(8)
			k = min(k, int(n-first))
			var p []byte
			for x := range k {
				p = append(p, stamp(first+uint64(x), ver)...)
			}
			if err := d.WriteAt(p, int64(first)*s, 0); err != nil {
				wrote <- err
				return
			}
			mu.Lock()
			for x := range k {
				versions[first+uint64(x)] = ver
			}
			mu.Unlock()
		}
	}()
	type ack struct {
		event    int
		gen      uint64
		versions []uint64
	}
	var acks []ack
	for range 25 {
		time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
		mu.Lock()
		vs := slices.Clone(versions)
		mu.Unlock()
		if err := d.Flush(); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		acks = append(acks, ack{rec.numEvents(), witness, vs})
		mu.Unlock()
	}
	close(stop)
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	d.Close()

	rng := rand.New(rand.NewPCG(3, 4))
	images := make([][]byte, len(acks))
	for k, a := range acks {
		images[k], _ = rec.crashImage(a.event, s, rng)
	}
	sources := append([][]byte{rec.base}, images...)
	got := make([]byte, s)
	for k, a := range acks {
		for si, src := range sources[:k+1] {
			img := bytes.Clone(images[k])
			for i := range uint64(n) {
				pos := v.l.DataPos(i)
				copy(img[pos:pos+s], src[pos:pos+s])
			}
			c := cfg
			c.OnFlushed, c.MinGeneration = nil, a.gen
			dd, err := Open(&memProvider{data: img}, c)
			if err != nil {
				t.Fatalf("flush %d, data of image %d put back: %v", k, si, err)
			}
			for i := range uint64(n) {
				err := dd.ReadAt(got, int64(i)*s)
				if err != nil {
					if !errors.Is(err, syscall.EIO) {
						t.Fatalf("flush %d, data of image %d: sector %d: %v", k, si, i, err)
					}
					continue
				}
				ver := binary.LittleEndian.Uint64(got[8:])
				if ver == 0 && bytes.Equal(got, make([]byte, s)) {
					ver = 0 // never written
				} else if !bytes.Equal(got, stamp(i, ver)) {
					t.Fatalf("flush %d, data of image %d: sector %d reads garbage", k, si, i)
				}
				if ver < a.versions[i] {
					t.Fatalf("flush %d (witness generation %d), data of image %d put back: sector %d reads version %d, older than the acknowledged %d",
						k, a.gen, si, i, ver, a.versions[i])
				}
			}
			dd.Close()
		}
	}
}

// forgeSlot seals a version 2 journal slot as only a holder of the journal key can, from
// docs/format.md alone: generation gen, reserved bytes 20..23 reserved, root, entries.
func forgeSlot(t *testing.T, gen uint64, reserved uint32, root [32]byte, entries []journalEntry) []byte {
	t.Helper()
	aead, err := chacha20poly1305.NewX(testJournalKey)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 80, 80+88*len(entries)+16)
	copy(b, "ELIJRNL2")
	binary.LittleEndian.PutUint64(b[8:], gen)
	binary.LittleEndian.PutUint32(b[16:], uint32(len(entries)))
	binary.LittleEndian.PutUint32(b[20:], reserved)
	copy(b[24:56], root[:])
	copy(b[56:80], "a nonce of 24 bytes.....")
	var plain []byte
	for _, e := range entries {
		plain = binary.LittleEndian.AppendUint64(plain, e.index)
		plain = append(plain, e.old[:]...)
		plain = append(plain, e.new[:]...)
	}
	return aead.Seal(b, b[56:80], plain, b[:56])
}

// TestJournalSlotRules: a version 2 journal slot that opens but breaks the format's rules
// (reserved bytes not zero, a generation in the other slot's place or 0, an entry past
// the last sector, a sector named twice) refuses the attach, whether it is the current
// slot or the other one, whose entries are otherwise never used. The same slot within
// the rules, in the other one's place, opens.
func TestJournalSlotRules(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, 300)
	d := v.open(t)
	for k := range 3 {
		if err := d.WriteAt(bytes.Repeat([]byte{byte(k + 1)}, 512), int64(k)*512*100, FUA); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	img := v.mem.snapshot()
	fr, ok, err := PeekFreshness(&memProvider{data: img}, v.l)
	if err != nil || !ok || fr.Generation < 3 {
		t.Fatalf("freshness %+v %v %v, want a few generations", fr, ok, err)
	}
	cur := fr.Generation
	var r record
	r[0] = 1
	one := []journalEntry{{index: 5, old: r, new: r}}
	cases := []struct {
		name    string
		forge   func(gen uint64) []byte
		wantErr string // "" for none
	}{
		{"within the rules", func(g uint64) []byte {
			if g > cur { // a current slot's entries must also give the tree's root
				return forgeSlot(t, g, 0, fr.Root, nil)
			}
			return forgeSlot(t, g, 0, fr.Root, one)
		}, ""},
		{"reserved bytes", func(g uint64) []byte { return forgeSlot(t, g, 1, fr.Root, one) }, "reserved bytes are not zero"},
		{"the other slot's generation", func(g uint64) []byte { return forgeSlot(t, g+1, 0, fr.Root, one) }, "which belongs in slot"},
		{"a sector past the end", func(g uint64) []byte {
			return forgeSlot(t, g, 0, fr.Root, []journalEntry{{index: 300, old: r, new: r}})
		}, "names sector 300 of 300"},
		{"a sector twice", func(g uint64) []byte { return forgeSlot(t, g, 0, fr.Root, append(one, one...)) }, "appears twice"},
	}
	for _, tc := range cases {
		// The other slot (one generation older than the current one), and the current
		// slot (the next generation, in the other slot's place).
		for _, gen := range []uint64{cur - 1, cur + 1} {
			t.Run(fmt.Sprintf("%s/generation %+d", tc.name, int64(gen)-int64(cur)), func(t *testing.T) {
				forged := bytes.Clone(img)
				off := v.l.JournalSlotOffset(int(gen % 2))
				clear(forged[off : off+v.l.JournalSlotLen()])
				copy(forged[off:], tc.forge(gen))
				cfg := v.cfg
				cfg.Logger = discardLogger()
				cfg.ReadOnly = true
				d, err := Open(&memProvider{data: forged}, cfg)
				if tc.wantErr == "" {
					if err != nil {
						t.Fatalf("a slot within the rules: %v", err)
					}
					d.Close()
					return
				}
				if err == nil {
					d.Close()
					t.Fatalf("Open accepted a slot with %s", tc.name)
				}
				if !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Open: %v, want an error saying %q", err, tc.wantErr)
				}
			})
		}
	}
}

// TestJournalGeneration0: a slot that opens with generation 0, which eli never writes
// (it stands for "no slot"), refuses the attach with a message that says so, not one that
// sends it to a slot where it would be just as wrong.
func TestJournalGeneration0(t *testing.T) {
	t.Parallel()
	v := newTestVolVersion(t, layout.Version2, sector.ModeXChaCha20Poly1305, 512, 300)
	img := v.mem.snapshot()
	copy(img[v.l.JournalSlotOffset(0):], forgeSlot(t, 0, 0, [32]byte{}, nil))
	cfg := v.cfg
	cfg.Logger = discardLogger()
	d, err := Open(&memProvider{data: img}, cfg)
	if err == nil {
		d.Close()
		t.Fatal("Open accepted a slot of generation 0")
	}
	msg := err.Error()
	if !errors.Is(err, ErrFreshness) || !strings.Contains(msg, "generation 0") || !strings.Contains(msg, "no slot may hold") || strings.Contains(msg, "belongs in slot") {
		t.Fatalf("Open: %v, want ErrFreshness saying that no slot may hold generation 0", err)
	}
}

package blockdev

import (
	"bytes"
	"compress/gzip"
	"crypto/cipher"
	"crypto/sha256"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/layout"

	"golang.org/x/crypto/chacha20poly1305"

	"github.com/elidisk/eli/sector"
)

// Golden volumes (docs/format.md): images written from fixed keys, a fixed volume ID and
// fixed nonces by a fixed list of operations. The tests open them with the real codec
// and check every byte of plaintext, and write them again from the same inputs and check
// every byte of the image, so any change of the format fails here until the files are
// regenerated on purpose:
//
//	go test -run Golden ./blockdev/ -update
//
// The header regions are zero: keys/ has its own golden headers.

const goldenDir = "testdata"

var updateGolden = flag.Bool("update", false, "rewrite the golden volumes in blockdev/testdata")

var (
	goldenDataKey    = seqBytes(0x00, 32)
	goldenJournalKey = seqBytes(0x20, 32)
	goldenVolumeID   = [16]byte{'e', 'l', 'i', '-', 'g', 'o', 'l', 'd', 'e', 'n', '-', 'v', 'o', 'l', '0', '1'}
)

const goldenProviderSize = 266240 // smallest size with two full groups of 512-byte sectors

// goldenProviderSize2 is the size of the format version 2 golden volume: two full groups,
// a partial one and the tree's seven nodes at the start of the data area.
const goldenProviderSize2 = 331776

// goldenFormats are the format versions with golden volumes: the file name prefix and the
// provider size of each.
var goldenFormats = []struct {
	version uint32
	prefix  string
	size    int64
}{
	{0, "golden-", goldenProviderSize},
	{layout.Version2, "golden-v2-", goldenProviderSize2},
}

func goldenSize(version uint32) int64 {
	for _, f := range goldenFormats {
		if f.version == version {
			return f.size
		}
	}
	panic("no golden format")
}

func seqBytes(from byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = from + byte(i)
	}
	return b
}

// goldenCodec is xchacha20-poly1305 exactly as docs/format.md specifies it ("Sector
// seal"), written out independently of sector/ and with nonces from a counter instead of
// the CSPRNG, so that images are reproducible. Reading the golden images with sector.New's
// codec then checks that codec against the spec too.
type goldenCodec struct {
	mu    sync.Mutex
	aead  cipher.AEAD
	count uint64
}

func (c *goldenCodec) Mode() Mode      { return sector.ModeXChaCha20Poly1305 }
func (c *goldenCodec) SectorSize() int { return 512 }
func (c *goldenCodec) MetaSize() int   { return 40 }
func (c *goldenCodec) Wipe()           {}
func (c *goldenCodec) Seal(index uint64, buf, meta []byte) {
	c.mu.Lock()
	c.count++
	n := sha256.Sum256(binary.LittleEndian.AppendUint64([]byte("eli-golden-nonce"), c.count))
	c.mu.Unlock()
	out := c.aead.Seal(nil, n[:24], buf, goldenAD(index))
	copy(buf, out[:512])
	copy(meta, n[:24])
	copy(meta[24:], out[512:])
}
func (c *goldenCodec) Open(index uint64, buf, meta []byte) error {
	out, err := c.aead.Open(nil, meta[:24], append(bytes.Clone(buf), meta[24:]...), goldenAD(index))
	if err != nil {
		return sector.ErrAuth
	}
	copy(buf, out)
	return nil
}

// SealRunMeta and OpenRunMeta (sector.MetaRunner): Seal and Open sector by sector, the
// records side by side in meta.
func (c *goldenCodec) SealRunMeta(first uint64, dst, src, meta []byte) {
	copy(dst, src)
	for k := 0; k < len(dst)/512; k++ {
		c.Seal(first+uint64(k), dst[k*512:(k+1)*512], meta[k*40:(k+1)*40])
	}
}
func (c *goldenCodec) OpenRunMeta(first uint64, dst, src, meta []byte) error {
	copy(dst, src)
	var bad []uint64
	for k := 0; k < len(dst)/512; k++ {
		if c.Open(first+uint64(k), dst[k*512:(k+1)*512], meta[k*40:(k+1)*40]) != nil {
			clear(dst[k*512 : (k+1)*512])
			bad = append(bad, first+uint64(k))
		}
	}
	if bad != nil {
		return &sector.RunAuthError{Sectors: bad}
	}
	return nil
}

// goldenAD is the additional data of docs/format.md, "Sector seal".
func goldenAD(index uint64) []byte {
	ad := append([]byte("eli-sector-v1"), goldenVolumeID[:]...)
	ad = append(ad, byte(sector.ModeXChaCha20Poly1305))
	ad = binary.LittleEndian.AppendUint32(ad, 512)
	return binary.LittleEndian.AppendUint64(ad, index)
}

// goldenOps is the fixed workload. Each op gets the device and the byte model.
var goldenOps = []struct {
	name string
	do   func(d *Device) error
	mod  func(m []byte)
}{
	{"four sectors, FUA", func(d *Device) error { return d.WriteAt(bytes.Repeat([]byte("eli!"), 512), 0, FUA) },
		func(m []byte) { copy(m, bytes.Repeat([]byte("eli!"), 512)) }},
	{"unaligned 700 bytes", func(d *Device) error { return d.WriteAt(seqBytes(0x40, 700), 1000, 0) },
		func(m []byte) { copy(m[1000:], seqBytes(0x40, 700)) }},
	{"across a group boundary", func(d *Device) error { return d.WriteAt(bytes.Repeat([]byte{0xa5, 0x5a}, 6*256), 100*512, 0) },
		func(m []byte) { copy(m[100*512:], bytes.Repeat([]byte{0xa5, 0x5a}, 6*256)) }},
	{"flush", func(d *Device) error { return d.Flush() }, func([]byte) {}},
	{"trim sectors 2-3", func(d *Device) error { return d.Trim(2*512, 2*512, 0) },
		func(m []byte) { clear(m[2*512 : 4*512]) }},
	{"zero 100 bytes mid-sector", func(d *Device) error { return d.WriteZeroes(101*512+50, 100, 0) },
		func(m []byte) { clear(m[101*512+50 : 101*512+150]) }},
	{"last sector", func(d *Device) error { return d.WriteAt(bytes.Repeat([]byte("last"), 128), d.Size()-512, 0) },
		func(m []byte) { copy(m[len(m)-512:], bytes.Repeat([]byte("last"), 128)) }},
	{"rewrite sector 0", func(d *Device) error { return d.WriteAt(bytes.Repeat([]byte("two!"), 128), 0, 0) },
		func(m []byte) { copy(m, bytes.Repeat([]byte("two!"), 128)) }},
}

func goldenLayout(t testing.TB, version uint32) Layout {
	l, err := layout.PlanVersion(version, goldenSize(version), 512, sector.ModeXChaCha20Poly1305, layout.Align)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// writeGolden runs the workload and returns the recorded I/O, the expected plaintext
// before the last commit and after it, and where the last commit's events start.
func writeGolden(t testing.TB, version uint32) (rec *recorder, before, after []byte, lastCommit int) {
	l := goldenLayout(t, version)
	mem := newMem(goldenSize(version))
	if err := Format(mem, l); err != nil {
		t.Fatal(err)
	}
	a, err := chacha20poly1305.NewX(goldenDataKey)
	if err != nil {
		t.Fatal(err)
	}
	rec = newRecorder(mem.data)
	d, err := Open(rec, Config{
		Layout: l, Codec: &goldenCodec{aead: a}, JournalKey: goldenJournalKey,
		CommitInterval: time.Hour, MaxBatchBytes: 1 << 30, Workers: -1,
		rand: &detRand{state: sha256.Sum256([]byte("eli-golden-journal"))},
	})
	if err != nil {
		t.Fatal(err)
	}
	model := make([]byte, d.Size())
	for _, op := range goldenOps {
		if err := op.do(d); err != nil {
			t.Fatalf("golden op %q: %v", op.name, err)
		}
		op.mod(model)
		if op.name == "flush" {
			before = bytes.Clone(model)
		}
	}
	// The last commit is Close's: everything after the flush.
	lastCommit = rec.numEvents()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	return rec, before, model, lastCommit
}

// goldenImages are the images checked in: a clean one, and two crashes inside the last
// commit, after its journal was synced: one where the data reached the provider but the
// metadata did not (recovery rolls forward), one the other way round (it rolls back).
func goldenImages(t testing.TB, version uint32, prefix string) map[string]struct {
	img  []byte
	want func(before, after []byte) []byte
	rec  Recovery
} {
	rec, _, _, last := writeGolden(t, version)
	clean := bytes.Clone(rec.cur)
	// Events of the last commit: journal, sync, data..., metadata blocks (and, in version
	// 2, tree nodes)..., sync, then Close's empty journal and its sync.
	ev := rec.events[last:]
	l := goldenLayout(t, version)
	if ev[0].kind != evWrite || ev[0].off < layout.Align || ev[0].off >= l.DataOffset || ev[1].kind != evSync {
		t.Fatalf("last commit does not start with journal and sync: %+v", ev[:2])
	}
	isMeta := func(e ioEvent) bool {
		if e.kind != evWrite || e.off < l.DataOffset || len(e.data) != l.MetaBlockSize() {
			return false
		}
		for g := range l.Groups() {
			if e.off == l.BlockPos(g) {
				return true
			}
		}
		return false
	}
	build := func(keep func(e ioEvent) bool) []byte {
		img := bytes.Clone(rec.base)
		for _, e := range rec.events[:last+2] {
			apply(img, e, e.off, e.off+e.size())
		}
		for _, e := range ev[2:] {
			if e.kind == evSync {
				break
			}
			if keep(e) {
				apply(img, e, e.off, e.off+e.size())
			}
		}
		return img
	}
	type g = struct {
		img  []byte
		want func(before, after []byte) []byte
		rec  Recovery
	}
	dataOnly := build(func(e ioEvent) bool { return !isMeta(e) })
	metaOnly := build(isMeta)
	return map[string]g{
		prefix + "xchacha20-poly1305-512.img.gz": {clean, func(_, a []byte) []byte { return a }, Recovery{Journal: "empty"}},
		prefix + "crash-data-written.img.gz": {dataOnly, func(_, a []byte) []byte { return a },
			Recovery{Journal: "replayed", Sectors: 5, RolledForward: 5}},
		// Trims always roll forward (a zero record needs no data); the writes roll back.
		prefix + "crash-records-written.img.gz": {metaOnly, func(b, _ []byte) []byte {
			b = bytes.Clone(b)
			clear(b[2*512 : 4*512])
			return b
		}, Recovery{Journal: "replayed", Sectors: 5, RolledForward: 2, RolledBack: 3}},
	}
}

func TestGoldenVolumesRead(t *testing.T) {
	t.Parallel()
	for _, f := range goldenFormats {
		testGoldenVolumesRead(t, f.version, f.prefix)
	}
}

func testGoldenVolumesRead(t *testing.T, version uint32, prefix string) {
	_, before, after, _ := writeGolden(t, version)
	l := goldenLayout(t, version)
	for name, g := range goldenImages(t, version, prefix) {
		t.Run(name, func(t *testing.T) {
			img := readGolden(t, name, version)
			codec, err := sector.New(sector.Params{Mode: sector.ModeXChaCha20Poly1305, SectorSize: 512,
				Key: goldenDataKey, VolumeID: goldenVolumeID})
			if err != nil {
				t.Fatal(err)
			}
			d, err := Open(&memProvider{data: img}, Config{Layout: l, Codec: codec, JournalKey: goldenJournalKey, Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			if got := d.Recovery(); got != g.rec {
				t.Errorf("recovery %+v, want %+v", got, g.rec)
			}
			got := make([]byte, d.Size())
			if err := d.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			want := g.want(before, after)
			if !bytes.Equal(got, want) {
				t.Fatal("plaintext differs from the golden workload's")
			}

			// Read-only: the same plaintext, recovered in memory, and not one byte written.
			img = readGolden(t, name, version)
			orig := bytes.Clone(img)
			ro, err := Open(&memProvider{data: img}, Config{Layout: l, Codec: codec, JournalKey: goldenJournalKey, ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			wantRec := g.rec
			wantRec.InMemory = g.rec.Journal == "replayed"
			if got := ro.Recovery(); got != wantRec {
				t.Errorf("read-only recovery %+v, want %+v", got, wantRec)
			}
			clear(got)
			if err := ro.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("read-only plaintext differs")
			}
			if err := ro.Close(); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(img, orig) {
				t.Fatal("a read-only attach wrote to the provider")
			}
		})
	}
}

func TestGoldenVolumesWrite(t *testing.T) {
	t.Parallel()
	for _, f := range goldenFormats {
		testGoldenVolumesWrite(t, f.version, f.prefix)
	}
}

func testGoldenVolumesWrite(t *testing.T, version uint32, prefix string) {
	for name, g := range goldenImages(t, version, prefix) {
		if *updateGolden {
			writeGoldenFile(t, name, g.img)
			continue
		}
		if !bytes.Equal(readGolden(t, name, version), g.img) {
			t.Errorf("%s: writing the golden workload again gives other bytes: the on-disk format changed. "+
				"If that is deliberate, bump the format version in docs/format.md and run go test -run Golden ./blockdev/ -update", name)
		}
	}
}

func readGolden(t *testing.T, name string, version uint32) []byte {
	size := goldenSize(version)
	f, err := os.Open(filepath.Join(goldenDir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	// The image's size is known: bound the read rather than trust the file.
	img, err := io.ReadAll(io.LimitReader(z, size+1))
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(img)) != size {
		t.Fatalf("%s: %d bytes, want %d", name, len(img), size)
	}
	return img
}

func writeGoldenFile(t *testing.T, name string, img []byte) {
	var buf bytes.Buffer
	z, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	z.Write(img)
	if err := z.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(goldenDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(goldenDir, name), buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(os.Stderr, "wrote %s (%d bytes)\n", name, buf.Len())
}

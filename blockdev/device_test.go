package blockdev

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

var modeCases = []struct {
	name       string
	mode       sector.Mode
	sectorSize int
	sectors    uint64
}{
	{"aead-512", sector.ModeXChaCha20Poly1305, 512, 350}, // 4 groups, the last partial
	{"aead-4096", sector.ModeXChaCha20Poly1305, 4096, 230},
	{"aead-65536", sector.ModeXChaCha20Poly1305, 65536, 20},
	{"xor-512", sector.ModeAESXTS128, 512, 300},
	{"aes-xts-4096", sector.ModeAESXTS256, 4096, 64},
	{"none-4096", sector.ModeNone, 4096, 64},
}

// TestRandomOpsMatchModel runs random writes (aligned or not), zeroes, trims, flushes and
// reads against a byte model, then reopens and compares everything.
func TestRandomOpsMatchModel(t *testing.T) {
	t.Parallel()
	for _, tc := range modeCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v := newTestVol(t, tc.mode, tc.sectorSize, tc.sectors)
			v.cfg.CommitInterval = time.Millisecond
			d := v.open(t)
			size := d.Size()
			model := make([]byte, size)
			if !tc.mode.Authenticated() {
				// Unwritten sectors of length-preserving modes read as the decryption of
				// whatever the provider holds: start from known zeroes.
				if err := d.WriteZeroes(0, size, 0); err != nil {
					t.Fatal(err)
				}
			}
			r := rand.New(rand.NewPCG(1, uint64(tc.sectorSize)))
			buf := make([]byte, 3<<20)
			for op := range 400 {
				off := r.Int64N(size)
				n := min(r.Int64N(int64(3*tc.sectorSize)+1), size-off)
				if r.IntN(8) == 0 {
					n = min(r.Int64N(3<<20), size-off)
				}
				switch k := r.IntN(10); {
				case k < 5:
					p := buf[:n]
					randFill(r, p)
					fl := Flags(0)
					if r.IntN(6) == 0 {
						fl = FUA
					}
					if err := d.WriteAt(p, off, fl); err != nil {
						t.Fatalf("op %d: write %d@%d: %v", op, n, off, err)
					}
					copy(model[off:], p)
				case k == 5:
					if err := d.WriteZeroes(off, n, Flags(r.IntN(2))*NoHole); err != nil {
						t.Fatalf("op %d: zeroes %d@%d: %v", op, n, off, err)
					}
					clear(model[off : off+n])
				case k == 6 && tc.mode.Authenticated():
					if err := d.Trim(off, n, 0); err != nil {
						t.Fatalf("op %d: trim: %v", op, err)
					}
					s := int64(tc.sectorSize)
					first, end := (off+s-1)/s*s, (off+n)/s*s
					if end > first {
						clear(model[first:end])
					}
				case k == 7:
					if err := d.Flush(); err != nil {
						t.Fatal(err)
					}
				default:
					p := buf[:n]
					if err := d.ReadAt(p, off); err != nil {
						t.Fatalf("op %d: read %d@%d: %v", op, n, off, err)
					}
					if !bytes.Equal(p, model[off:off+n]) {
						t.Fatalf("op %d: read %d@%d differs from the model", op, n, off)
					}
				}
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			if tc.mode.Authenticated() && d.Stats().Commits == 0 {
				t.Fatal("no commits happened")
			}
			d = v.open(t)
			defer d.Close()
			if rec := d.Recovery(); tc.mode.Authenticated() && rec.Journal != "empty" {
				t.Fatalf("after a clean close, recovery found journal %q", rec.Journal)
			}
			got := make([]byte, size)
			if err := d.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, model) {
				t.Fatal("reopened volume differs from the model")
			}
			// Data is stored transformed (except in mode none).
			if tc.mode != sector.ModeNone {
				raw := v.mem.snapshot()
				for i := uint64(0); i < tc.sectors; i++ {
					pt := model[int(i)*tc.sectorSize : int(i+1)*tc.sectorSize]
					if bytes.Count(pt, []byte{0}) == len(pt) {
						continue
					}
					pos := v.l.DataPos(i)
					if bytes.Equal(raw[pos:pos+int64(tc.sectorSize)], pt) {
						t.Fatalf("sector %d is stored in the clear", i)
					}
				}
			}
		})
	}
}

func TestErrors(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 100)
	d := v.open(t)
	size := d.Size()
	cases := []struct {
		name string
		err  error
		want syscall.Errno
	}{
		{"read past end", d.ReadAt(make([]byte, 2), size-1), syscall.EINVAL},
		{"read negative", d.ReadAt(make([]byte, 2), -1), syscall.EINVAL},
		{"write past end", d.WriteAt(make([]byte, 2), size-1, 0), syscall.ENOSPC},
		{"write huge offset", d.WriteAt(make([]byte, 2), 1<<62, 0), syscall.ENOSPC},
		{"zeroes past end", d.WriteZeroes(size, 1, 0), syscall.ENOSPC},
		{"trim overflow", d.Trim(1, 1<<63-1, 0), syscall.ENOSPC},
	}
	for _, c := range cases {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: got %v, want an error wrapping %v", c.name, c.err, c.want)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.ReadAt(make([]byte, 1), 0); !errors.Is(err, syscall.ESHUTDOWN) {
		t.Errorf("read after close: %v", err)
	}

	v.cfg.ReadOnly = true
	ro := v.open(t)
	defer ro.Close()
	for name, err := range map[string]error{
		"write":  ro.WriteAt([]byte{1}, 0, 0),
		"zeroes": ro.WriteZeroes(0, 1, 0),
		"trim":   ro.Trim(0, 512, 0),
	} {
		if !errors.Is(err, syscall.EPERM) {
			t.Errorf("read-only %s: %v, want EPERM", name, err)
		}
	}
	if err := ro.Flush(); err != nil {
		t.Errorf("read-only flush: %v", err)
	}
}

func TestOpenRefusesMismatch(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 100)
	cases := map[string]func(c *Config){
		"codec sector size": func(c *Config) { c.Codec = newCodec(t, sector.ModeXChaCha20Poly1305, 512, testVolumeID) },
		"codec mode":        func(c *Config) { c.Codec = newCodec(t, sector.ModeNone, 4096, testVolumeID) },
		"journal key":       func(c *Config) { c.JournalKey = c.JournalKey[:16] },
		"no codec":          func(c *Config) { c.Codec = nil },
		"too many sectors":  func(c *Config) { c.Layout.Sectors += 1000 },
		"journal length":    func(c *Config) { c.Layout.JournalLen += 4096 },
	}
	for name, mut := range cases {
		cfg := v.cfg
		mut(&cfg)
		if d, err := Open(v.mem, cfg); err == nil {
			d.Close()
			t.Errorf("%s: Open accepted it", name)
		}
	}
}

func TestWriteZeroesFastZero(t *testing.T) {
	t.Parallel()
	for _, tc := range modeCases {
		v := newTestVol(t, tc.mode, tc.sectorSize, tc.sectors)
		d := v.open(t)
		err := d.WriteZeroes(0, int64(4*tc.sectorSize), FastZero)
		want := tc.mode.Authenticated() || tc.mode == sector.ModeNone
		if want && err != nil {
			t.Errorf("%s: fast zero: %v", tc.name, err)
		}
		if !want && !errors.Is(err, syscall.ENOTSUP) {
			t.Errorf("%s: fast zero gave %v, want ENOTSUP", tc.name, err)
		}
		// What needs a read-modify-write (part of a sector), or sealed zeroes (NoHole in
		// an authenticated mode), is no faster than writing: ENOTSUP, and nothing
		// changes.
		s := int64(tc.sectorSize)
		slow := []struct {
			off, n int64
			flags  Flags
		}{{s / 2, s, FastZero}, {0, s + s/2, FastZero}}
		if tc.mode.Authenticated() {
			slow = append(slow, struct {
				off, n int64
				flags  Flags
			}{0, 4 * s, FastZero | NoHole})
		}
		for _, z := range slow {
			if err := d.WriteAt(bytes.Repeat([]byte{7}, int(4*s)), 0, 0); err != nil {
				t.Fatal(err)
			}
			if err := d.WriteZeroes(z.off, z.n, z.flags); !errors.Is(err, syscall.ENOTSUP) {
				t.Errorf("%s: fast zero of %d bytes at %d (flags %#x) gave %v, want ENOTSUP", tc.name, z.n, z.off, z.flags, err)
			}
			got := make([]byte, 4*s)
			if err := d.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, bytes.Repeat([]byte{7}, int(4*s))) {
				t.Errorf("%s: a refused fast zero changed the data", tc.name)
			}
		}
		d.Close()
	}
}

// TestFormatFile formats a real file full of garbage: it must read as zeroes, stay sparse
// and keep the header regions intact.
func TestFormatFile(t *testing.T) {
	t.Parallel()
	l, size := layoutFor(t, sector.ModeXChaCha20Poly1305, 4096, 500, layout.DefaultJournalLen)
	path := filepath.Join(t.TempDir(), "vol")
	garbage := bytes.Repeat([]byte{0xa5}, int(size))
	if err := os.WriteFile(path, garbage, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := Format(f, l); err != nil {
		t.Fatal(err)
	}
	d, err := Open(f, Config{Layout: l, Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 4096, testVolumeID), JournalKey: testJournalKey})
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, d.Size())
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if bytes.Count(got, []byte{0}) != len(got) {
		t.Fatal("formatted volume does not read as zeroes")
	}
	d.Close()
	raw, _ := os.ReadFile(path)
	if !bytes.Equal(raw[:layout.HeaderRegionLen], garbage[:layout.HeaderRegionLen]) || !bytes.Equal(raw[size-layout.HeaderCopyLen:], garbage[:layout.HeaderCopyLen]) {
		t.Fatal("Format touched a header region")
	}
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 > size/2 {
		t.Errorf("formatted file uses %d of %d bytes: not punched", st.Blocks*512, size)
	}
}

// TestFormatWithoutPunch zeroes only the journal and the metadata blocks.
func TestFormatWithoutPunch(t *testing.T) {
	t.Parallel()
	l, size := layoutFor(t, sector.ModeXChaCha20Poly1305, 512, 300, layout.Align)
	mem := newMem(size)
	for i := range mem.data {
		mem.data[i] = 0x5a
	}
	if err := Format(noPunch{mem}, l); err != nil {
		t.Fatal(err)
	}
	d, err := Open(mem, Config{Layout: l, Codec: newCodec(t, sector.ModeXChaCha20Poly1305, 512, testVolumeID), JournalKey: testJournalKey})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	got := make([]byte, d.Size())
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if bytes.Count(got, []byte{0}) != len(got) {
		t.Fatal("volume does not read as zeroes")
	}
	if mem.data[l.DataPos(5)] != 0x5a {
		t.Fatal("Format without punch wrote data sectors (it needs only the metadata)")
	}
}

type noPunch struct{ *memProvider }

func (noPunch) Capabilities() provider.Capabilities { return provider.Capabilities{} }

// TestCacheBounded writes across many groups with a cache of four blocks: the cache never
// holds more, and commits split into rounds that fit it.
func TestCacheBounded(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 102*40)
	v.cfg.CacheBytes = 4 * 4096
	d := v.open(t)
	model := make([]byte, d.Size())
	r := rand.New(rand.NewPCG(3, 4))
	p := make([]byte, 512)
	for range 300 {
		off := r.Int64N(d.Size()/512) * 512
		randFill(r, p)
		if err := d.WriteAt(p, off, 0); err != nil {
			t.Fatal(err)
		}
		copy(model[off:], p)
		if st := d.Stats(); st.CacheBlocks > 4 {
			t.Fatalf("cache holds %d blocks, bound 4", st.CacheBlocks)
		}
	}
	if err := d.Flush(); err != nil {
		t.Fatal(err)
	}
	st := d.Stats()
	if st.Rounds <= st.Commits {
		t.Fatalf("%d rounds for %d commits: a batch over 40 groups should need several rounds of 2", st.Rounds, st.Commits)
	}
	got := make([]byte, d.Size())
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model) {
		t.Fatal("content differs from the model")
	}
	if st := d.Stats(); st.CacheBlocks > 4 || st.CacheEvictions == 0 {
		t.Fatalf("cache holds %d blocks after %d evictions", st.CacheBlocks, st.CacheEvictions)
	}
	d.Close()
}

// TestCacheWarm: Cache loads the range's metadata blocks, at most as many as the cache holds.
func TestCacheWarm(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 102*10)
	v.cfg.CacheBytes = 4 * 4096
	d := v.open(t)
	defer d.Close()
	if err := d.Cache(0, d.Size()); err != nil {
		t.Fatal(err)
	}
	if st := d.Stats(); st.CacheBlocks != 4 || st.CacheLoads != 4 {
		t.Fatalf("after Cache of 10 groups with room for 4: %+v", st)
	}
	if err := d.Cache(0, d.Size()+1); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("Cache past the end: %v", err)
	}
}

// serialProvider counts the WriteAt calls in flight, and says whether it asks for serial
// writes (provider.Capabilities.SerialWrites).
type serialProvider struct {
	*memProvider
	serial         bool
	inFlight, most atomic.Int32
	writes         atomic.Int64
}

func (p *serialProvider) Capabilities() provider.Capabilities {
	return provider.Capabilities{SerialWrites: p.serial, Punch: p.memProvider.Punch}
}

func (p *serialProvider) WriteAt(b []byte, off int64) (int, error) {
	n := p.inFlight.Add(1)
	for {
		m := p.most.Load()
		if n <= m || p.most.CompareAndSwap(m, n) {
			break
		}
	}
	time.Sleep(50 * time.Microsecond) // long enough for a parallel writer to overlap
	p.writes.Add(1)
	defer p.inFlight.Add(-1)
	return p.memProvider.WriteAt(b, off)
}

// TestSerialWrites: a provider whose writes serialize (regular files) gets its commit's
// data writes from one thread, and one that does not (block devices) in parallel; the
// data reads back either way.
func TestSerialWrites(t *testing.T) {
	t.Parallel()
	for _, serial := range []bool{true, false} {
		v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 2000)
		p := &serialProvider{memProvider: v.mem, serial: serial}
		d, err := Open(p, v.cfg)
		if err != nil {
			t.Fatal(err)
		}
		// 4 MiB in one commit: 4 data writes of 256 KiB at least, across groups.
		data := make([]byte, 4<<20)
		for i := range data {
			data[i] = byte(i*7 + i>>12)
		}
		if err := d.WriteAt(data, 0, FUA); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(data))
		if err := d.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("serial=%v: data differs", serial)
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		most := p.most.Load()
		switch {
		case p.writes.Load() < 8:
			t.Fatalf("serial=%v: only %d writes", serial, p.writes.Load())
		case serial && most != 1:
			t.Errorf("serial provider saw %d writes at once", most)
		case !serial && most < 2 && runtime.GOMAXPROCS(0) > 1:
			t.Errorf("parallel provider never saw two writes at once")
		}
	}
}

// onceProvider counts, for TestMetadataMapping, the reads a provider with a mapping
// would make through it (ReadAt) and by system call (ReadOnce), and the writes into its
// mapping (WriteMapped) and by system call (WriteAt), each at metadata-block positions.
type onceProvider struct {
	*memProvider
	isBlock              func(off int64) bool
	readAt, readOnce     atomic.Int64
	writeAt, writeMapped atomic.Int64
}

func (p *onceProvider) note(c *atomic.Int64, off int64) {
	if p.isBlock(off) {
		c.Add(1)
	}
}

func (p *onceProvider) ReadAt(b []byte, off int64) (int, error) {
	p.note(&p.readAt, off)
	return p.memProvider.ReadAt(b, off)
}

func (p *onceProvider) ReadOnce(b []byte, off int64) (int, error) {
	p.note(&p.readOnce, off)
	return p.memProvider.ReadAt(b, off)
}

func (p *onceProvider) WriteAt(b []byte, off int64) (int, error) {
	p.note(&p.writeAt, off)
	return p.memProvider.WriteAt(b, off)
}

func (p *onceProvider) Capabilities() provider.Capabilities {
	return provider.Capabilities{Punch: p.memProvider.Punch, ReadOnce: p.ReadOnce, WriteMapped: p.WriteMapped}
}

func (p *onceProvider) WriteMapped(b []byte, off int64) (bool, error) {
	p.note(&p.writeMapped, off)
	_, err := p.memProvider.WriteAt(b, off)
	return true, err
}

// TestMetadataMapping: where the provider reads through a mapping, metadata blocks are
// loaded by system call (a first touch through a mapping costs more than the read), and
// a block is copied into the mapping only once it has been written pwritesBeforeMapping
// times by system call.
func TestMetadataMapping(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 4096, 2000)
	geo := newGeometry(v.l)
	blocks := map[int64]bool{}
	for g := uint64(0); g*geo.perGroup < 2000; g++ {
		blocks[geo.blockPos(g)] = true
	}
	p := &onceProvider{memProvider: v.mem, isBlock: func(off int64) bool { return blocks[off] }}
	d, err := Open(p, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Sector 0 written and committed ten times: its block is written ten times.
	buf := make([]byte, 4096)
	for i := range 10 {
		buf[0] = byte(i)
		if err := d.WriteAt(buf, 0, FUA); err != nil {
			t.Fatal(err)
		}
	}
	got := make([]byte, 4096)
	if err := d.ReadAt(got, 0); err != nil || got[0] != 9 {
		t.Fatalf("read back %d, %v", got[0], err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if p.readOnce.Load() == 0 || p.readAt.Load() != 0 {
		t.Errorf("metadata blocks loaded %d times by ReadOnce, %d by ReadAt; want all by ReadOnce", p.readOnce.Load(), p.readAt.Load())
	}
	if w, m := p.writeAt.Load(), p.writeMapped.Load(); w != pwritesBeforeMapping || m != 10-pwritesBeforeMapping {
		t.Errorf("block written %d times by WriteAt and %d through the mapping, want %d and %d", w, m, pwritesBeforeMapping, 10-pwritesBeforeMapping)
	}
}

// TestCloseWipesJournalKey: the device's copy of the journal key, in its keyring, is
// overwritten by Close: the cipher made from it no longer opens what it sealed.
func TestCloseWipesJournalKey(t *testing.T) {
	t.Parallel()
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, 300)
	d := v.open(t)
	k := &authOf(d).keys
	aead := k.cur.journal
	nonce := make([]byte, aead.NonceSize())
	sealed := aead.Seal(nil, nonce, []byte("journal"), nil)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if k.cur.journal != nil {
		t.Fatal("the keyring still holds the journal cipher after Close")
	}
	if _, err := aead.Open(nil, nonce, sealed, nil); err == nil {
		t.Fatal("the journal cipher still opens what it sealed after Close: its key was not wiped")
	}
}

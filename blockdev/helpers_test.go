package blockdev

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"

	"github.com/elidisk/eli/sector"
)

var (
	testDataKey = func() []byte { // the longest mode key (aes-xts), halves distinct
		k := make([]byte, 64)
		for i := range k {
			k[i] = byte(0xd4 + 7*i)
		}
		return k
	}()
	testJournalKey = bytes.Repeat([]byte{0x7a}, 32)
	testVolumeID   = [16]byte{0xe1, 0x1e, 0x00, 0x01, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}
)

// memProvider is an in-memory provider that can punch.
type memProvider struct {
	mu   sync.RWMutex
	data []byte
}

func newMem(size int64) *memProvider { return &memProvider{data: make([]byte, size)} }

func (m *memProvider) Size() int64 { return int64(len(m.data)) }

func (m *memProvider) ReadAt(b []byte, off int64) (int, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if off < 0 || off+int64(len(b)) > int64(len(m.data)) {
		return 0, fmt.Errorf("memProvider: read [%d, %d) outside %d bytes", off, off+int64(len(b)), len(m.data))
	}
	return copy(b, m.data[off:]), nil
}

func (m *memProvider) WriteAt(b []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || off+int64(len(b)) > int64(len(m.data)) {
		return 0, fmt.Errorf("memProvider: write [%d, %d) outside %d bytes", off, off+int64(len(b)), len(m.data))
	}
	return copy(m.data[off:], b), nil
}

func (m *memProvider) Punch(off, n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.data[off : off+n])
	return nil
}

func (m *memProvider) Sync() error { return nil }

func (m *memProvider) Capabilities() provider.Capabilities {
	return provider.Capabilities{Punch: m.Punch}
}

func (m *memProvider) snapshot() []byte {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return bytes.Clone(m.data)
}

// layoutFor builds a layout with exactly n sectors and the smallest provider for it.
func layoutFor(t testing.TB, mode sector.Mode, sectorSize int, n uint64, journalLen int64) (Layout, int64) {
	t.Helper()
	return layoutForVersion(t, 0, mode, sectorSize, n, journalLen)
}

// layoutForVersion is layoutFor in a format version (0 or layout.Version2).
func layoutForVersion(t testing.TB, version uint32, mode sector.Mode, sectorSize int, n uint64, journalLen int64) (Layout, int64) {
	t.Helper()
	if testFormat2 && mode.Authenticated() {
		version = layout.Version2
	}
	l := Layout{Version: version, Mode: mode, SectorSize: sectorSize, DataOffset: layout.HeaderRegionLen, Sectors: n}
	if l.MetaSize() > 0 {
		l.JournalLen = journalLen
		l.DataOffset += journalLen
	}
	size := (l.DataOffset+l.Span()+layout.Align-1)/layout.Align*layout.Align + layout.HeaderCopyLen
	if err := l.Validate(size); err != nil {
		t.Fatal(err)
	}
	return l, size
}

// xorCodec is a stand-in length-preserving codec, independent of sector's: a keystream
// from SHA-256 of the index. newCodec returns it for ModeAESXTS128 (the real aes-xts is
// tested as ModeAESXTS256).
type xorCodec struct{ size int }

func (c xorCodec) Mode() Mode      { return sector.ModeAESXTS128 }
func (c xorCodec) SectorSize() int { return c.size }
func (c xorCodec) MetaSize() int   { return 0 }
func (c xorCodec) Wipe()           {}
func (c xorCodec) Seal(i uint64, buf, _ []byte) {
	var seed [8]byte
	binary.LittleEndian.PutUint64(seed[:], i)
	for k := 0; k < len(buf); k += 32 {
		ks := sha256.Sum256(append(seed[:], byte(k>>5), byte(k>>13)))
		for x := 0; x < 32 && k+x < len(buf); x++ {
			buf[k+x] ^= ks[x]
		}
	}
}
func (c xorCodec) Open(i uint64, buf, meta []byte) error { c.Seal(i, buf, meta); return nil }

// SealRun and OpenRun (sector.Runner): Seal sector by sector, from src into dst.
func (c xorCodec) SealRun(first uint64, dst, src []byte) {
	copy(dst, src)
	for k := 0; k < len(dst); k += c.size {
		c.Seal(first+uint64(k/c.size), dst[k:k+c.size], nil)
	}
}
func (c xorCodec) OpenRun(first uint64, dst, src []byte) error {
	c.SealRun(first, dst, src)
	return nil
}

type Mode = sector.Mode

func newCodec(t testing.TB, mode sector.Mode, sectorSize int, vol [16]byte) sector.Codec {
	t.Helper()
	if mode == sector.ModeAESXTS128 {
		return xorCodec{sectorSize}
	}
	c, err := sector.New(sector.Params{Mode: mode, SectorSize: sectorSize, Key: testDataKey[:mode.KeySize()], VolumeID: vol})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

type testVol struct {
	l    Layout
	mem  *memProvider
	file *provider.File // in place of mem, if set (newFileVol)
	cfg  Config
	size int64
}

// testFormat2 (ELI_TEST_FORMAT2=1) makes every test volume of an authenticated mode a
// format version 2 volume: a way to run the whole suite against the hash tree.
var testFormat2 = os.Getenv("ELI_TEST_FORMAT2") == "1"

// skipFormat2 skips a test that asserts what format version 1 does (positions, or
// tampering version 2 detects) when ELI_TEST_FORMAT2 makes its volume version 2;
// fresh_test.go asserts version 2's behaviour.
func skipFormat2(t *testing.T) {
	if testFormat2 {
		t.Skip("asserts format version 1; ELI_TEST_FORMAT2 makes the volume version 2")
	}
}

// newTestVol formats a memory provider for mode with n sectors.
func newTestVol(t testing.TB, mode sector.Mode, sectorSize int, n uint64) *testVol {
	t.Helper()
	return newTestVolVersion(t, 0, mode, sectorSize, n)
}

// newTestVolVersion is newTestVol in a format version (0 or layout.Version2).
func newTestVolVersion(t testing.TB, version uint32, mode sector.Mode, sectorSize int, n uint64) *testVol {
	t.Helper()
	l, size := layoutForVersion(t, version, mode, sectorSize, n, layout.Align)
	mem := newMem(size)
	if err := Format(mem, l); err != nil {
		t.Fatal(err)
	}
	return &testVol{l: l, mem: mem, size: size, cfg: Config{
		Layout: l, Codec: newCodec(t, mode, sectorSize, testVolumeID), JournalKey: testJournalKey,
		Logger: testLogger(t),
	}}
}

// newFileVol formats a file in dir for mode with n sectors, as eli's attach opens it
// (provider.Open: on tmpfs, read through a mapping).
func newFileVol(t testing.TB, dir string, mode sector.Mode, sectorSize int, n uint64) *testVol {
	t.Helper()
	l, size := layoutFor(t, mode, sectorSize, n, layout.Align)
	f := sparseFile(t, filepath.Join(dir, "vol"), size)
	if err := Format(f, l); err != nil {
		t.Fatal(err)
	}
	return &testVol{l: l, file: f, size: size, cfg: Config{
		Layout: l, Codec: newCodec(t, mode, sectorSize, testVolumeID), JournalKey: testJournalKey,
		Logger: testLogger(t),
	}}
}

// sparseFile creates a sparse file of size bytes at path and opens it as eli does.
func sparseFile(t testing.TB, path string, size int64) *provider.File {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	f, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// shmDir is a directory on tmpfs, where provider.File maps the volume.
func shmDir(t testing.TB) string {
	t.Helper()
	dir, err := tempDirIn(t, "/dev/shm")
	if err != nil {
		t.Fatalf("a tmpfs for the mapped provider: %v", err)
	}
	return dir
}

// tempDirIn makes a directory in parent that is removed when t ends.
func tempDirIn(t testing.TB, parent string) (string, error) {
	dir, err := os.MkdirTemp(parent, "eli-")
	if err == nil {
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	return dir, err
}

func (v *testVol) open(t testing.TB) *Device {
	t.Helper()
	var p provider.Provider = v.mem
	if v.file != nil {
		p = v.file
	}
	d, err := Open(p, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// testLogger sends the device's log lines to the test log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(bytes.TrimRight(p, "\n")))
	return len(p), nil
}

// discardLogger is for tests that open thousands of devices.
func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

func randFill(r *rand.Rand, b []byte) {
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

// detRand is a deterministic stream for journal nonces in golden tests.
type detRand struct{ state [32]byte }

func (r *detRand) Read(p []byte) (int, error) {
	for i := range p {
		if i%32 == 0 {
			r.state = sha256.Sum256(r.state[:])
		}
		p[i] = r.state[i%32]
	}
	return len(p), nil
}

var _ io.Reader = (*detRand)(nil)

// authOf is d's authenticated engine, for tests of its batches.
func authOf(d *Device) *authEngine { return d.eng.(*authEngine) }

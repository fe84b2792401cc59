package keys

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"testing"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/sector"
)

// memProvider is an in-memory provider of fixed size (like a block device).
type memProvider struct {
	mu    sync.Mutex
	b     []byte
	syncs int
}

func newMem(size int64) *memProvider { return &memProvider{b: make([]byte, size)} }

func (m *memProvider) ReadAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || off >= int64(len(m.b)) {
		return 0, io.EOF
	}
	n := copy(p, m.b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (m *memProvider) WriteAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || off+int64(len(p)) > int64(len(m.b)) {
		return 0, fmt.Errorf("write of %d bytes at %d past the end (%d)", len(p), off, len(m.b))
	}
	return copy(m.b[off:], p), nil
}

func (m *memProvider) Sync() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.syncs++
	return nil
}

func (m *memProvider) Size() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return int64(len(m.b))
}

// grow extends the provider with zeroes, as a grown file or device.
func (m *memProvider) grow(size int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.b = append(m.b, make([]byte, size-int64(len(m.b)))...)
}

func (m *memProvider) bytesAt(off, n int64) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]byte(nil), m.b[off:off+n]...)
}

func (m *memProvider) put(off int64, p []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	copy(m.b[off:], p)
}

func (m *memProvider) clone() *memProvider {
	m.mu.Lock()
	defer m.mu.Unlock()
	return &memProvider{b: append([]byte(nil), m.b...)}
}

var errCrashed = errors.New("simulated crash")

// crashProvider lets `writes` WriteAt calls through, then tears the next one (only its
// first `torn` bytes land) and fails it and everything after, as a power cut would.
type crashProvider struct {
	*memProvider
	writes int
	torn   int
	dead   bool
}

func (c *crashProvider) WriteAt(p []byte, off int64) (int, error) {
	if c.dead {
		return 0, errCrashed
	}
	if c.writes == 0 {
		c.dead = true
		n, _ := c.memProvider.WriteAt(p[:min(c.torn, len(p))], off)
		return n, errCrashed
	}
	c.writes--
	return c.memProvider.WriteAt(p, off)
}

func (c *crashProvider) Sync() error {
	if c.dead {
		return errCrashed
	}
	return c.memProvider.Sync()
}

// countingReader yields 0, 1, 2, ... (mod 256): a predictable "random" source.
type countingReader struct{ next byte }

func (r *countingReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = r.next
		r.next++
	}
	return len(p), nil
}

// tiny is the cheapest KDF the bounds allow, for tests that run many unlocks.
var tiny = KDFParams{Time: 1, MemoryKiB: 64, Threads: 1}

const testSize = 4 << 20

// testLayout fits a provider of testSize bytes.
func testLayout() Layout {
	return Layout{
		Mode:       sector.ModeXChaCha20Poly1305,
		SectorSize: 4096,
		JournalLen: 65536,
		DataOffset: 131072,
		Sectors:    500,
	}
}

func pass(s string) Credentials { return Credentials{Passphrase: []byte(s)} }

// newVolume creates a volume on a fresh memProvider with slot 0 under passphrase "pw0".
func newVolume(t testing.TB) (*memProvider, *MasterKey) {
	t.Helper()
	p := newMem(testSize)
	mk, err := Create(p, testLayout(), pass("pw0"), tiny)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	t.Cleanup(mk.Wipe)
	return p, mk
}

func mustRead(t testing.TB, p *memProvider) *Header {
	t.Helper()
	h, err := Read(p)
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	return h
}

// unlock reads the header and unlocks it, wiping the key it returns.
func unlock(p *memProvider, c Credentials, slot int) (int, error) {
	h, err := Read(p)
	if err != nil {
		return -1, err
	}
	mk, i, err := h.Unlock(c, slot)
	if err != nil {
		return -1, err
	}
	mk.Wipe()
	return i, nil
}

// mustUnlock checks that c opens the volume through slot want and yields mk.
func mustUnlock(t testing.TB, p *memProvider, c Credentials, want int, mk *MasterKey) {
	t.Helper()
	h := mustRead(t, p)
	got, i, err := h.Unlock(c, AnySlot)
	if err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	defer got.Wipe()
	if i != want {
		t.Errorf("Unlock opened slot %d, want %d", i, want)
	}
	if mk != nil && (string(got.Bytes()) != string(mk.Bytes()) || got.VolumeID() != mk.VolumeID()) {
		t.Errorf("Unlock returned another master key")
	}
}

func copyB(p *memProvider) int64 { return layout.HeaderBOffset(p.Size()) }

// rewrite replaces the header copy at off with raw after fixing its checksum (what an
// attacker, or another writer, can always do).
func rewrite(p *memProvider, off int64, raw []byte) {
	var r [HeaderSize]byte
	copy(r[:], raw)
	setChecksum(&r)
	p.put(off, r[:])
}

func writeFile(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

package provider

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

func tempFile(t *testing.T, size int64) string {
	t.Helper()
	return fileIn(t, t.TempDir(), size)
}

// fileIn is a new sparse file of size bytes in dir.
func fileIn(t testing.TB, dir string, size int64) string {
	t.Helper()
	p := filepath.Join(dir, "prov")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, size); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestFile(t *testing.T) {
	t.Parallel()
	path := tempFile(t, 1<<20)
	p, err := Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.Size() != 1<<20 || p.IsBlockDevice() || !p.Capabilities().SerialWrites || p.Path() != path {
		t.Fatalf("size %d, block %v, serial writes %v, path %q", p.Size(), p.IsBlockDevice(), p.Capabilities().SerialWrites, p.Path())
	}
	data := bytes.Repeat([]byte{0xa5}, 64<<10)
	if _, err := p.WriteAt(data, 4096); err != nil {
		t.Fatal(err)
	}
	if err := p.Sync(); err != nil {
		t.Fatal(err)
	}
	// Punch makes a range read as zeroes, leaving its neighbours and the size alone.
	if err := p.Punch(8192, 16384); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if _, err := p.ReadAt(got, 4096); err != nil {
		t.Fatal(err)
	}
	want := bytes.Clone(data)
	clear(want[4096 : 4096+16384])
	if !bytes.Equal(got, want) {
		t.Fatal("punch did not zero exactly its range")
	}
	if st, _ := os.Stat(path); st.Size() != 1<<20 {
		t.Fatalf("punch changed the size to %d", st.Size())
	}
	if err := p.Punch(0, 0); err != nil {
		t.Fatalf("empty punch: %v", err)
	}
}

func TestExtend(t *testing.T) {
	t.Parallel()
	p, err := Open(tempFile(t, 1<<20), false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Extend(4 << 20); err != nil || p.Size() != 4<<20 {
		t.Fatalf("extend: %v, size %d", err, p.Size())
	}
	if err := p.Extend(4 << 20); err != nil {
		t.Fatalf("extend to the same size: %v", err)
	}
	if err := p.Extend(1 << 20); err == nil || !strings.Contains(err.Error(), "shrink") {
		t.Fatalf("shrink: %v, want a refusal", err)
	}
}

func TestLock(t *testing.T) {
	t.Parallel()
	path := tempFile(t, 1<<20)
	a, err := Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Lock(); err != nil {
		t.Fatal(err)
	}
	b, err := Open(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Lock(); !errors.Is(err, ErrInUse) {
		t.Fatalf("second lock: %v, want ErrInUse", err)
	}
	a.Close() // releases the lock
	if err := b.Lock(); err != nil {
		t.Fatalf("lock after the holder closed: %v", err)
	}
}

func TestFromFile(t *testing.T) {
	t.Parallel()
	path := tempFile(t, 12345)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	p, err := FromFile(f, path)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.Size() != 12345 || p.File() != f {
		t.Fatalf("size %d", p.Size())
	}
}

func TestRefusesOtherFiles(t *testing.T) {
	t.Parallel()
	if _, err := Open(t.TempDir(), true); err == nil {
		t.Fatal("a directory was accepted as a provider")
	}
	if _, err := Open("/dev/null", true); err == nil || !strings.Contains(err.Error(), "neither a regular file nor a block device") {
		t.Fatalf("a character device: %v", err)
	}
	if _, err := Open(filepath.Join(t.TempDir(), "missing"), true); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a missing file: %v", err)
	}
}

// TestBlockDevice runs the block-device paths (size by ioctl, BLKZEROOUT, no Extend) on a
// loop device.
func TestBlockDevice(t *testing.T) {
	testtool.NeedRoot(t)
	losetup := testtool.Need(t, "losetup", "mount")
	backing := tempFile(t, 8<<20)
	if err := os.WriteFile(backing, bytes.Repeat([]byte{0x5a}, 8<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(losetup, "-f", "--show", backing).Output()
	if err != nil {
		testtool.Missing(t, "a free loop device ("+err.Error()+")")
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command(losetup, "-d", dev).Run() })

	p, err := Open(dev, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if !p.IsBlockDevice() || p.Capabilities().SerialWrites || p.Size() != 8<<20 {
		t.Fatalf("block %v, serial writes %v, size %d", p.IsBlockDevice(), p.Capabilities().SerialWrites, p.Size())
	}
	if c := CapabilitiesOf(p); !c.BlockDevice || c.SerialWrites || c.Punch == nil || c.AtomicWrite < 512 || c.AtomicWrite&(c.AtomicWrite-1) != 0 {
		t.Fatalf("a loop device's capabilities: %+v", stateOf(c))
	}
	if err := p.Punch(1<<20, 64<<10); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 128<<10)
	if _, err := p.ReadAt(got, 1<<20-32<<10); err != nil {
		t.Fatal(err)
	}
	for i, b := range got {
		inside := i >= 32<<10 && i < 32<<10+64<<10
		if (b == 0) != inside {
			t.Fatalf("byte %d of the window is %#x after zeroing [1 MiB, +64 KiB)", i, b)
		}
	}
	if err := p.Extend(16 << 20); err == nil {
		t.Fatal("Extend of a block device did not refuse")
	}
	if err := p.Lock(); err != nil {
		t.Fatal(err)
	}
}

// The capability answers a provider type gives: a File's, a bare provider's (none), one
// with capability methods but no Capabilities (none: methods alone state nothing), and a
// Capable wrapper's (its own answer).
type (
	bare      struct{ Provider }
	punching  struct{ Provider }
	described struct {
		Provider
		caps Capabilities
	}
)

func (punching) Punch(off, length int64) error { return nil }
func (punching) SerialWrites() bool            { return true }
func (p described) Capabilities() Capabilities { return p.caps }

// stated is what Capabilities say, in a comparable form: the fields, and whether each
// operation is there.
type stated struct {
	serial, shared, block bool
	atomic                int
	punch, mapped, once   bool
}

func stateOf(c Capabilities) stated {
	return stated{c.SerialWrites, c.Shared, c.BlockDevice, c.AtomicWrite, c.Punch != nil, c.WriteMapped != nil, c.ReadOnce != nil}
}

func TestCapabilitiesOf(t *testing.T) {
	t.Parallel()
	path := tempFile(t, 1<<20)
	f, err := Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	punch := func(off, length int64) error { return nil }
	all := Capabilities{SerialWrites: true, Punch: punch, AtomicWrite: 512, Shared: true, BlockDevice: true}
	for _, tc := range []struct {
		name string
		p    Provider
		want stated
	}{
		{"file", f, stated{serial: true, punch: true, mapped: true, once: true}},
		{"bare", bare{f}, stated{}},
		{"methods without Capabilities", punching{f}, stated{}},
		{"capable", described{f, all}, stated{serial: true, shared: true, block: true, atomic: 512, punch: true}},
		{"capable of nothing", described{f, Capabilities{}}, stated{}},
	} {
		if got := stateOf(CapabilitiesOf(tc.p)); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
	// A File's operations are its own: Punch makes the range read as zeroes.
	if _, err := f.WriteAt([]byte{1, 2, 3, 4}, 4096); err != nil {
		t.Fatal(err)
	}
	if err := CapabilitiesOf(f).Punch(4096, 4096); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	if _, err := CapabilitiesOf(f).ReadOnce(got, 4096); err != nil || !bytes.Equal(got, make([]byte, 4)) {
		t.Fatalf("after Capabilities().Punch: %v, %v", got, err)
	}
}

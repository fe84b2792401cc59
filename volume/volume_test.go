package volume

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/nbd"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// TestFlagMap: each of nbd's request flags reaches blockdev as the flag of the same
// meaning, alone and together, and a bit nbd might add later is dropped rather than
// read as one of blockdev's.
func TestFlagMap(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   nbd.Flags
		want blockdev.Flags
	}{
		{0, 0},
		{nbd.FUA, blockdev.FUA},
		{nbd.NoHole, blockdev.NoHole},
		{nbd.FastZero, blockdev.FastZero},
		{nbd.FUA | nbd.NoHole, blockdev.FUA | blockdev.NoHole},
		{nbd.FUA | nbd.NoHole | nbd.FastZero, blockdev.FUA | blockdev.NoHole | blockdev.FastZero},
		{1 << 15, 0},
		{nbd.FUA | 1<<8, blockdev.FUA},
	} {
		if got := devFlags(tc.in); got != tc.want {
			t.Errorf("devFlags(%#x) = %#x, want %#x", tc.in, got, tc.want)
		}
	}
	// Every bit maps to at most one bit, and no two map to the same one.
	seen := map[blockdev.Flags]nbd.Flags{}
	for bit := nbd.Flags(1); bit != 0; bit <<= 1 {
		got := devFlags(bit)
		if got&(got-1) != 0 {
			t.Errorf("nbd flag %#x maps to several blockdev flags %#x", bit, got)
		}
		if got == 0 {
			continue
		}
		if prev, ok := seen[got]; ok {
			t.Errorf("nbd flags %#x and %#x both map to %#x", prev, bit, got)
		}
		seen[got] = bit
	}
	if len(seen) != len(flagMap) {
		t.Errorf("%d nbd flags map to something, want the %d of flagMap", len(seen), len(flagMap))
	}
}

// TestErrorMap: a read that failed in one sector becomes an *nbd.OffsetError naming the
// sector's offset, and still wraps the errno (and sector.ErrAuth) that decide the NBD
// error value; other errors pass unchanged.
func TestErrorMap(t *testing.T) {
	t.Parallel()
	se := &blockdev.SectorError{Sector: 7, Offset: 7 * 4096, Err: sector.ErrAuth}
	err := nbdErr(fmt.Errorf("read: %w", se))
	var oe *nbd.OffsetError
	if !errors.As(err, &oe) || oe.Offset != 7*4096 {
		t.Fatalf("nbdErr(SectorError) = %v, want an *nbd.OffsetError at %d", err, 7*4096)
	}
	if !errors.Is(err, syscall.EIO) || !errors.Is(err, sector.ErrAuth) {
		t.Errorf("mapped error %v lost EIO or ErrAuth", err)
	}
	for _, e := range []error{blockdev.ErrReadOnly, blockdev.ErrOutOfRange, syscall.ENOSPC} {
		if got := nbdErr(e); got != e {
			t.Errorf("nbdErr(%v) = %v, want it unchanged", e, got)
		}
	}
}

// testVolume makes a provider in dir with a real header (quick KDF) and returns it, its
// layout and its master key.
func testVolume(t testing.TB, dir string, size int64, mode sector.Mode) (string, layout.Layout, *keys.MasterKey) {
	t.Helper()
	return elitest.Volume(t, dir, size, mode)
}

// copyKey is a master key the test can hand to something that wipes it.
func copyKey(t testing.TB, mk *keys.MasterKey) *keys.MasterKey {
	t.Helper()
	return elitest.CopyKey(t, mk)
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// TestVolumeReadReportsSectorOffset: through the Volume (the backend nbd calls), a read
// over a tampered sector fails with an *nbd.OffsetError at the sector's start, or at
// the request's start when it begins inside the sector; CACHE reaches blockdev.
func TestVolumeReadReportsSectorOffset(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path, l, mk := testVolume(t, dir, 16<<20, sector.Default)
	defer mk.Wipe()
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	v, err := Open(p, copyKey(t, mk), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	s := int64(l.SectorSize)
	if err := v.Cache(0, 64*s); err != nil {
		t.Fatal(err)
	}
	if st := v.dev.Stats(); st.CacheLoads == 0 {
		t.Errorf("Cache loaded no metadata block: %+v", st)
	}
	data := bytes.Repeat([]byte("eli!"), int(8*s/4))
	if err := v.WriteAt(data, 0, nbd.FUA); err != nil {
		t.Fatal(err)
	}
	flipByte(t, path, l.DataPos(5)+100)
	for _, tc := range []struct {
		off, n, want int64
	}{
		{0, 8 * s, 5 * s},
		{5 * s, s, 5 * s},
		{5*s + 512, 1024, 5*s + 512},
		{4 * s, 2 * s, 5 * s},
	} {
		err := v.ReadAt(make([]byte, tc.n), tc.off)
		var oe *nbd.OffsetError
		if !errors.As(err, &oe) || oe.Offset != tc.want {
			t.Errorf("read [%d, +%d): %v, want an *nbd.OffsetError at %d", tc.off, tc.n, err, tc.want)
		}
	}
	if err := v.ReadAt(make([]byte, 4*s), 0); err != nil {
		t.Errorf("read of the sectors before the tampered one: %v", err)
	}
	st := v.Status()
	if st.AuthFailures == 0 || st.Reads != 5 || st.Writes != 1 || st.Caches != 1 || st.LastError == "" {
		t.Errorf("status after the reads: %+v", st)
	}
	if st.State != StateServing {
		t.Errorf("a tampered sector made the volume %s; only a provider failure does", st.State)
	}
}

// failingProvider fails every write and sync once armed, as a full or dying disk does.
type failingProvider struct {
	*provider.File
	armed atomic.Bool
}

func (f *failingProvider) WriteAt(b []byte, off int64) (int, error) {
	if f.armed.Load() {
		return 0, syscall.ENOSPC
	}
	return f.File.WriteAt(b, off)
}

func (f *failingProvider) Sync() error {
	if f.armed.Load() {
		return syscall.ENOSPC
	}
	return f.File.Sync()
}

// TestVolumeFailsOnProviderError: in every kind of mode, a write or flush the provider
// refuses marks the volume failed, with the error in its status, and Close reports it;
// a request's own mistake (read-only, out of range) does not.
func TestVolumeFailsOnProviderError(t *testing.T) {
	t.Parallel()
	for _, mode := range []sector.Mode{sector.Default, sector.ModeAESXTS256} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			path, _, mk := testVolume(t, t.TempDir(), 8<<20, mode)
			defer mk.Wipe()
			pf, err := provider.Open(path, false)
			if err != nil {
				t.Fatal(err)
			}
			defer pf.Close()
			p := &failingProvider{File: pf}
			v, err := Open(p, copyKey(t, mk), Options{})
			if err != nil {
				t.Fatal(err)
			}
			if err := v.WriteAt(make([]byte, 4096), v.Size(), 0); err == nil {
				t.Fatal("write past the end succeeded")
			}
			if st := v.Status(); st.State != StateServing || st.LastError == "" {
				t.Fatalf("a write past the end: %+v; want serving, with the error as the last", st)
			}
			p.armed.Store(true)
			werr := v.WriteAt(bytes.Repeat([]byte{1}, 8192), 0, 0)
			ferr := v.Flush()
			if werr == nil && ferr == nil {
				t.Fatal("write and flush on a failing provider both succeeded")
			}
			if !errors.Is(ferr, syscall.ENOSPC) {
				t.Errorf("flush: %v, want ENOSPC", ferr)
			}
			st := v.Status()
			if st.State != StateFailed || st.Error == "" || v.Err() == nil {
				t.Errorf("status after the provider failed: %+v", st)
			}
			if err := v.Close(); err == nil && mode.Authenticated() {
				t.Error("Close of a failed authenticated volume reported success")
			}
		})
	}
}

// TestWriteThroughSurvivesKill: with WriteThrough, every acknowledged write is already
// committed, so a copy of the provider taken at that instant (what a server killed then
// leaves) opens with every write in it; without it, writes still in the batch are not.
func TestWriteThroughSurvivesKill(t *testing.T) {
	t.Parallel()
	for _, wt := range []bool{true, false} {
		dir := t.TempDir()
		path, l, mk := testVolume(t, dir, 16<<20, sector.Default)
		defer mk.Wipe()
		p, err := provider.Open(path, false)
		if err != nil {
			t.Fatal(err)
		}
		v, err := Open(p, copyKey(t, mk), Options{WriteThrough: wt})
		if err != nil {
			t.Fatal(err)
		}
		s := int64(l.SectorSize)
		want := make([][]byte, 32)
		for i := range want {
			want[i] = bytes.Repeat([]byte{byte(i + 1)}, int(s))
			if err := v.WriteAt(want[i], int64(i)*2*s, 0); err != nil {
				t.Fatal(err)
			}
		}
		// The "killed" server's provider, as it is now.
		img, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		copyPath := filepath.Join(dir, "killed.img")
		if err := os.WriteFile(copyPath, img, 0o600); err != nil {
			t.Fatal(err)
		}
		v.Close()
		p.Close()

		p2, err := provider.Open(copyPath, false)
		if err != nil {
			t.Fatal(err)
		}
		v2, err := Open(p2, copyKey(t, mk), Options{})
		if err != nil {
			t.Fatal(err)
		}
		lost := 0
		got := make([]byte, s)
		for i := range want {
			if err := v2.ReadAt(got, int64(i)*2*s); err != nil {
				t.Fatalf("write-through %v: sector %d after the kill: %v", wt, 2*i, err)
			}
			if !bytes.Equal(got, want[i]) {
				lost++
			}
		}
		v2.Close()
		p2.Close()
		if wt && lost > 0 {
			t.Errorf("write-through: %d of %d acknowledged writes lost in a kill", lost, len(want))
		}
		if !wt {
			t.Logf("write-back: %d of %d acknowledged writes were still in the batch", lost, len(want))
		}
	}
}

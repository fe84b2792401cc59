package provider

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

const sampleMountinfo = `22 1 0:21 / /proc rw,nosuid - proc proc rw
36 22 43:0 / /mnt/with\040space rw,relatime shared:1 - ext4 /dev/nbd0 rw
37 22 43:1 / /other rw - ext4 /dev/nbd0p1 rw
38 22 43:0 /sub /bind rw - ext4 /dev/nbd0 rw
`

func TestMountPoints(t *testing.T) {
	t.Parallel()
	got := MountPoints(strings.NewReader(sampleMountinfo), "43:0")
	if strings.Join(got, "|") != "/mnt/with space|/bind" {
		t.Errorf("MountPoints = %q", got)
	}
	if got := MountPoints(strings.NewReader(sampleMountinfo), "43:32"); len(got) != 0 {
		t.Errorf("MountPoints(unmounted) = %q", got)
	}
	for in, want := range map[string]string{`a\134b`: `a\b`, `tab\011`: "tab\t", `end\`: `end\`, `x\09`: `x\09`} {
		if got := unescapeMount(in); got != want {
			t.Errorf("unescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestLockShared: readers share the lock, a writer excludes them and they it.
func TestLockShared(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "p")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	open := func(ro bool) *File {
		p, err := Open(path, ro)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		return p
	}
	r1, r2, w := open(true), open(true), open(false)
	if err := r1.LockShared(); err != nil {
		t.Fatal(err)
	}
	if err := r2.LockShared(); err != nil {
		t.Fatalf("a second reader: %v", err)
	}
	if err := w.Lock(); !errors.Is(err, ErrInUse) {
		t.Fatalf("a writer beside readers: %v, want ErrInUse", err)
	}
	r1.Close()
	r2.Close()
	if err := w.Lock(); err != nil {
		t.Fatalf("a writer once the readers are gone: %v", err)
	}
	if err := open(true).LockShared(); !errors.Is(err, ErrInUse) {
		t.Fatalf("a reader beside a writer: %v, want ErrInUse", err)
	}
}

// TestOpenExclusiveBusy: a block device held exclusively (here by another
// OpenExclusive) is refused with a BusyError; a free one opens.
func TestOpenExclusiveBusy(t *testing.T) {
	t.Parallel()
	testtool.NeedRoot(t)
	losetup := testtool.Need(t, "losetup", "mount")
	img := filepath.Join(t.TempDir(), "img")
	if err := os.WriteFile(img, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(losetup, "--find", "--show", img).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	loop := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command(losetup, "-d", loop).Run() })
	a, err := OpenExclusive(loop)
	if err != nil {
		t.Fatal(err)
	}
	_, err = OpenExclusive(loop)
	var busy *BusyError
	if !errors.As(err, &busy) || !errors.Is(err, ErrBusy) {
		t.Fatalf("second exclusive open: %v, want a BusyError", err)
	}
	a.Close()
	b, err := OpenExclusive(loop)
	if err != nil {
		t.Fatalf("exclusive open once free: %v", err)
	}
	b.Close()
}

package sysvm

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// TestOptions describe a machine for NewTest.
type TestOptions struct {
	Root    RootOptions
	Disks   []DiskSpec // data disks, /dev/vdb on, each a new zeroed Disk
	Memory  int        // MiB; 0 means Config's default
	CPUs    int
	Network bool // a NIC (and RootOptions.Network's configuration for it)
	Cmdline string
}

// DiskSpec is a data disk to create.
type DiskSpec struct {
	Name string
	Size int64
}

// NewTest prepares a machine for t, not yet booted: it checks the tools (testtool: a
// missing one skips, or fails under ELI_REQUIRE_TOOLS=1), finds the cached kernel and
// root file system, builds the root disk and creates the data disks in t's temporary
// directory. Cleanup kills qemu; if t failed, it logs the end of the last boot's console.
func NewTest(t testing.TB, opts TestOptions) *Machine {
	t.Helper()
	qemu := testtool.Need(t, "qemu-system-x86_64", "qemu-system-x86")
	busybox := testtool.Need(t, "busybox", "busybox-static")
	testtool.Need(t, "mkfs.ext4", "e2fsprogs")
	testtool.Need(t, "depmod", "kmod")
	testtool.Need(t, "tar", "tar")
	testtool.NeedRoot(t)
	a, err := FindAssets()
	if err != nil {
		testtool.Missing(t, err.Error())
	}
	start := time.Now()
	dir := t.TempDir()
	rootOpts := opts.Root
	rootOpts.Network = rootOpts.Network || opts.Network
	rootImg := filepath.Join(dir, "root.img")
	if err := BuildRoot(rootImg, a, rootOpts); err != nil {
		t.Fatal(err)
	}
	t.Logf("root file system built in %v", time.Since(start).Round(time.Millisecond))
	root, err := OpenDisk(rootImg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { root.Close() })
	var disks []NamedDisk
	for _, s := range opts.Disks {
		d, err := CreateDisk(filepath.Join(dir, s.Name+".img"), s.Size)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		disks = append(disks, NamedDisk{Name: s.Name, Disk: d})
	}
	m, err := New(Config{
		Assets: a, Dir: dir, QEMU: qemu, Busybox: busybox,
		Root: root, Disks: disks,
		Memory: opts.Memory, CPUs: opts.CPUs, Network: opts.Network, Cmdline: opts.Cmdline,
		Logf: func(format string, args ...any) {
			t.Logf("%6.1fs "+format, append([]any{time.Since(start).Seconds()}, args...)...)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.Close()
		if t.Failed() && m.Boots() > 0 {
			t.Logf("console of boot %d (end):\n%s", m.Boots(), tail(m.Console(), 6000))
		}
	})
	return m
}

// Disk returns the data disk called name, or the root disk for "root"; nil if none.
func (m *Machine) Disk(name string) *Disk {
	if name == "root" {
		return m.cfg.Root
	}
	for _, d := range m.cfg.Disks {
		if d.Name == name {
			return d.Disk
		}
	}
	return nil
}

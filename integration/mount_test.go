package integration

import (
	"crypto/sha256"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// Scenario 2 (issue 6): eli as a Linux block device with a real filesystem. Attach,
// nbdfuse + losetup, mkfs.ext4, mount, write a tree of files with known checksums,
// unmount, fsck -fn clean, detach; attach and mount again: the checksums hold.
//
// Not parallel: loop devices and mounts are the machine's, and the kernel's page cache
// and writeback are shared.
func TestMountExt4(t *testing.T) {
	needBlockTools(t)
	for _, cfg := range []struct {
		mode   string
		sector int
	}{
		{"xchacha20-poly1305", 4096},
		{"aes-xts", 512},
	} {
		t.Run(fmt.Sprintf("%s/%d", cfg.mode, cfg.sector), func(t *testing.T) {
			e := newEnv(t, true)
			img := e.create(volume{name: "fs.img", size: "128M", mode: cfg.mode, sector: cfg.sector})

			uri := e.Attach(img)
			dev, undoDev := e.blockDevice(uri, cfg.sector)
			command(t, time.Minute, "mkfs.ext4", "-q", "-F", dev)
			dir, undoMount := e.mount(dev)
			want := writeTree(t, dir, 20260601+uint64(cfg.sector))
			undoMount()
			fsck(t, dev)
			undoDev()
			e.detach("fs.img")

			uri = e.Attach(img)
			dev, undoDev = e.blockDevice(uri, cfg.sector)
			dir, undoMount = e.mount(dev, "-o", "ro")
			got := readTree(t, dir)
			if len(got) != len(want) {
				t.Errorf("after re-attach the tree has %d files, want %d", len(got), len(want))
			}
			for name, h := range want {
				if got[name] != h {
					t.Errorf("%s: checksum changed after detach and attach", name)
				}
			}
			undoMount()
			fsck(t, dev)
			undoDev()
			e.detach("fs.img")
		})
	}
}

// writeTree writes nested directories of files (empty, small, a few MiB; about 20 MiB in
// all) with contents from a seeded PRNG and returns each file's SHA-256 by relative path.
func writeTree(t *testing.T, root string, seed uint64) map[string][32]byte {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 6))
	sums := map[string][32]byte{}
	for f := 0; f < 150; f++ {
		dir := filepath.Join(fmt.Sprintf("d%d", rng.IntN(5)), fmt.Sprintf("e%d", rng.IntN(4)))
		if rng.IntN(3) == 0 {
			dir = filepath.Join(dir, fmt.Sprintf("f%d", rng.IntN(3)))
		}
		var size int
		switch r := rng.IntN(100); {
		case r < 5:
			size = 0
		case r < 95:
			size = rng.IntN(96 << 10)
		default:
			size = 1<<20 + rng.IntN(3<<20)
		}
		data := make([]byte, size)
		fillRandom(rng, data)
		name := filepath.Join(dir, fmt.Sprintf("file%03d.bin", f))
		if err := os.MkdirAll(filepath.Join(root, dir), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
		sums[name] = sha256.Sum256(data)
	}
	return sums
}

// readTree returns the SHA-256 of every regular file under root by relative path.
func readTree(t *testing.T, root string) map[string][32]byte {
	t.Helper()
	sums := map[string][32]byte{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "lost+found" {
			return filepath.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		sums[rel] = sha256.Sum256(b)
		return nil
	})
	if err != nil {
		t.Fatalf("read the tree back: %v", err)
	}
	return sums
}

// fsck runs a forced, read-only e2fsck and fails unless the filesystem is clean.
func fsck(t *testing.T, dev string) {
	t.Helper()
	out, err := commandErr(2*time.Minute, "e2fsck", "-f", "-n", dev)
	if err != nil {
		t.Fatalf("e2fsck -fn %s: %v\n%s", dev, err, out)
	}
	// Pass 5 is the last; a clean run reports files and blocks and nothing fixed.
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if !slices.ContainsFunc(lines, func(l string) bool { return strings.Contains(l, "Pass 5") }) {
		t.Fatalf("e2fsck did not run all passes:\n%s", out)
	}
}

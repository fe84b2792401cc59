package sysvm

import (
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

//go:embed rootfs.packages
var rootfsPackages []byte

//go:embed mkrootfs.sh
var mkrootfsScript []byte

// RootfsKey names the cached root file system: the first 16 hex digits of the SHA-256 of
// rootfs.packages followed by mkrootfs.sh, as scripts/test computes it
// (cat rootfs.packages mkrootfs.sh | sha256sum), so that changing either builds a new one.
func RootfsKey() string {
	h := sha256.New()
	h.Write(rootfsPackages)
	h.Write(mkrootfsScript)
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// Assets are what scripts/test caches for a boot: Debian's kernel with part of its
// module tree, and the Debian root file system tarball.
type Assets struct {
	Dir           string // ELI_VM_DIR, default /var/cache/eli-vm
	Kernel        string // vmlinux (uncompressed, booted through PVH) or else vmlinuz
	KernelVersion string // uname -r: 6.1.0-N-amd64
	Modules       string // holds kernel/ (the module trees kept) and modules.builtin
	Rootfs        string // debian-bookworm-KEY.tar
}

// CacheDir is where scripts/test keeps the kernel and the root file system.
func CacheDir() string {
	if d := os.Getenv("ELI_VM_DIR"); d != "" {
		return d
	}
	return "/var/cache/eli-vm"
}

// moduleTrees are the parts of the kernel's module tree (directories or single modules)
// that the guest needs besides those integration/vm_test.go needs; scripts/test caches
// them and completes an older cache that lacks them.
var moduleTrees = []string{"drivers/virtio", "drivers/char", "net/core",
	"drivers/net/virtio_net.ko", "drivers/net/net_failover.ko", "drivers/block", "fs"}

// FindAssets locates the cached kernel (the newest linux-* in CacheDir, as
// integration/vm_test.go picks it) and root file system; the error says what is missing
// and that scripts/test fetches it.
func FindAssets() (Assets, error) {
	a := Assets{Dir: CacheDir()}
	found, _ := filepath.Glob(filepath.Join(a.Dir, "linux-*", "vmlinuz"))
	if len(found) == 0 {
		return a, fmt.Errorf("no Debian 6.1 kernel in %s (scripts/test fetches it)", a.Dir)
	}
	sort.Strings(found)
	k := filepath.Dir(found[len(found)-1])
	// The uncompressed kernel boots through PVH, skipping the firmware's real-mode
	// loader and the decompression, which take seconds under TCG.
	a.Kernel = filepath.Join(k, "vmlinux")
	if _, err := os.Stat(a.Kernel); err != nil {
		a.Kernel = filepath.Join(k, "vmlinuz")
	}
	a.Modules = k
	a.KernelVersion = strings.TrimPrefix(filepath.Base(k), "linux-")
	need := []string{"modules.builtin", "modules.order"}
	for _, t := range moduleTrees {
		need = append(need, filepath.Join("kernel", t))
	}
	for _, p := range need {
		if _, err := os.Stat(filepath.Join(k, p)); err != nil {
			return a, fmt.Errorf("the kernel cache %s lacks %s, which sysvm's guest needs (scripts/test completes it)", k, p)
		}
	}
	a.Rootfs = filepath.Join(a.Dir, "debian-bookworm-"+RootfsKey()+".tar")
	if _, err := os.Stat(a.Rootfs); err != nil {
		return a, fmt.Errorf("no Debian root file system %s (scripts/test builds it with integration/sysvm/mkrootfs.sh)", a.Rootfs)
	}
	return a, nil
}

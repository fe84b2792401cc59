package sysvm

import (
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/elidisk/eli/integration/vm"
)

// DefaultModules are the kernel modules the guest's root file system holds (with their
// dependencies) for udev and modprobe to load: its virtio devices, ext4, nbd and loop.
var DefaultModules = []string{"virtio_pci", "virtio_blk", "virtio_net", "virtio_console",
	"virtio_rng", "ext4", "crc32c_generic", "nbd", "loop", "autofs4"}

// masked are units of a stock Debian that a test boot has no use for, masked so that
// they cost no boot time (every process started is slow under TCG) and wake nothing up
// during a test: package and scrub timers, the gettys and logind (the test talks to the
// agent, nobody logs in), utmp records, and the kernel file systems and modules for
// debugging, tracing, huge pages, message queues, FUSE and device mapper.
var masked = []string{"apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer",
	"e2scrub_all.timer", "e2scrub_reap.service", "fstrim.timer", "getty.target",
	"systemd-logind.service", "systemd-update-utmp.service", "systemd-update-utmp-runlevel.service",
	"dev-hugepages.mount", "dev-mqueue.mount", "sys-kernel-debug.mount", "sys-kernel-tracing.mount",
	"sys-kernel-config.mount", "proc-sys-fs-binfmt_misc.automount", "systemd-pstore.service",
	"modprobe@configfs.service", "modprobe@dm_mod.service", "modprobe@drm.service",
	"modprobe@efi_pstore.service", "modprobe@fuse.service"}

// File is a file put into the guest's root file system.
type File struct {
	Path    string      // absolute, in the guest
	Data    []byte      // contents, unless Src or Symlink is set
	Src     string      // a host file to copy instead
	Mode    fs.FileMode // permission bits; 0 means 0644
	Symlink string      // make Path a symlink to this instead
}

// RootOptions shape the guest's root file system.
type RootOptions struct {
	Size int64 // bytes (a sparse file); 0 means 2 GiB
	// Network configures the NIC that Config.Network adds with systemd-networkd
	// (10.0.2.15/24 on qemu's user network), and makes network-online.target wait for it.
	Network bool
	Modules []string // kernel modules beyond DefaultModules
	Fstab   []string // lines added to /etc/fstab after the root's
	Files   []File   // put in last, over anything else
}

const (
	agentPath = "/usr/local/sbin/eli-test-agent"
	agentPort = "eli.agent" // the virtio-serial port's name
)

// agentUnit starts the agent as early as systemd starts anything (its port's driver is
// loaded by the initramfs), so that the test can look into a boot that hangs, and keeps
// it through an isolate to emergency.target.
var agentUnit = `[Unit]
Description=sysvm test agent (runs the test's scripts from the virtio port ` + agentPort + `)
DefaultDependencies=no
IgnoreOnIsolate=yes
Conflicts=shutdown.target
Before=shutdown.target

[Service]
ExecStart=` + agentPath + `
Restart=always
RestartSec=1

[Install]
WantedBy=sysinit.target
`

const networkUnit = `[Match]
Type=ether

[Network]
Address=10.0.2.15/24
Gateway=10.0.2.2
`

// buildAgent builds the guest agent, statically linked, at dst.
func buildAgent(dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	cmd := exec.Command("go", "build", "-trimpath", "-o", dst, "github.com/elidisk/eli/integration/sysvm/agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("sysvm: build the guest agent: %v\n%s", err, out)
	}
	return nil
}

// BuildRoot makes the ext4 image of the guest's root file system at path: the cached
// Debian tarball, the kernel's modules, the test agent and its units, a persistent
// journal, and what opts add. It runs as root, which a tarball of a system's files needs
// to keep their owners; tar, mkfs.ext4 and depmod (kmod) must be installed.
func BuildRoot(path string, a Assets, opts RootOptions) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("sysvm: building a root file system needs root (the files' owners)")
	}
	size := opts.Size
	if size == 0 {
		size = 2 << 30
	}
	tmp, err := os.MkdirTemp(filepath.Dir(path), "rootfs-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if out, err := exec.Command("tar", "-C", tmp, "--numeric-owner", "-xpf", a.Rootfs).CombinedOutput(); err != nil {
		return fmt.Errorf("sysvm: unpack %s: %v\n%s", a.Rootfs, err, out)
	}
	machineID := make([]byte, 16)
	rand.Read(machineID)
	fstab := "/dev/vda / ext4 rw,errors=remount-ro 0 1\n"
	for _, l := range opts.Fstab {
		fstab += l + "\n"
	}
	files := []File{
		{Path: "/etc/hostname", Data: []byte("sysvm\n")},
		{Path: "/etc/hosts", Data: []byte("127.0.0.1 localhost\n127.0.1.1 sysvm\n")},
		// A machine ID of its own: no first-boot presets, and journalctl finds the
		// journals of earlier boots in /var/log/journal/ID.
		{Path: "/etc/machine-id", Data: []byte(hex.EncodeToString(machineID) + "\n")},
		{Path: "/etc/fstab", Data: []byte(fstab)},
		{Path: "/etc/systemd/journald.conf.d/sysvm.conf", Data: []byte("[Journal]\nStorage=persistent\n")},
		{Path: "/etc/systemd/system/default.target", Symlink: "/lib/systemd/system/multi-user.target"},
		{Path: "/etc/systemd/system/eli-test-agent.service", Data: []byte(agentUnit)},
		{Path: "/etc/systemd/system/sysinit.target.wants/eli-test-agent.service", Symlink: "../eli-test-agent.service"},
	}
	for _, u := range masked {
		files = append(files, File{Path: "/etc/systemd/system/" + u, Symlink: "/dev/null"})
	}
	if opts.Network {
		files = append(files,
			File{Path: "/etc/systemd/network/20-sysvm.network", Data: []byte(networkUnit)},
			File{Path: "/etc/systemd/system/multi-user.target.wants/systemd-networkd.service", Symlink: "/lib/systemd/system/systemd-networkd.service"},
			File{Path: "/etc/systemd/system/sockets.target.wants/systemd-networkd.socket", Symlink: "/lib/systemd/system/systemd-networkd.socket"},
			File{Path: "/etc/systemd/system/network-online.target.wants/systemd-networkd-wait-online.service", Symlink: "/lib/systemd/system/systemd-networkd-wait-online.service"})
	}
	if err := buildAgent(filepath.Join(tmp, agentPath)); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(tmp, "var/log/journal"), 0o755); err != nil {
		return err
	}
	if err := installModules(tmp, a, append(append([]string(nil), DefaultModules...), opts.Modules...)); err != nil {
		return err
	}
	for _, f := range append(files, opts.Files...) {
		if err := putFile(tmp, f); err != nil {
			return err
		}
	}
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-L", "root", "-d", tmp, path, fmt.Sprint(size/1024)+"k").CombinedOutput()
	if err != nil {
		return fmt.Errorf("sysvm: mkfs.ext4 -d: %v\n%s", err, out)
	}
	return nil
}

// putFile writes f under root.
func putFile(root string, f File) error {
	if !strings.HasPrefix(f.Path, "/") {
		return fmt.Errorf("sysvm: guest path %q is not absolute", f.Path)
	}
	dst := filepath.Join(root, f.Path)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	os.Remove(dst)
	if f.Symlink != "" {
		return os.Symlink(f.Symlink, dst)
	}
	data := f.Data
	if f.Src != "" {
		var err error
		if data, err = os.ReadFile(f.Src); err != nil {
			return err
		}
	}
	mode := f.Mode
	if mode == 0 {
		mode = 0o644
	}
	if err := os.WriteFile(dst, data, mode); err != nil {
		return err
	}
	return os.Chmod(dst, mode) // past the umask
}

// installModules copies names and their dependencies into the image's module tree and
// indexes it with depmod, so that udev and modprobe load them by alias and by name.
func installModules(root string, a Assets, names []string) error {
	kroot := filepath.Join(a.Modules, "kernel")
	mods, err := vm.Resolve(kroot, names)
	if err != nil {
		return fmt.Errorf("sysvm: kernel modules: %w", err)
	}
	dst := filepath.Join(root, "lib/modules", a.KernelVersion)
	for _, m := range mods {
		rel, err := filepath.Rel(a.Modules, m)
		if err != nil {
			return err
		}
		if err := putFile(root, File{Path: filepath.Join("/lib/modules", a.KernelVersion, rel), Src: m}); err != nil {
			return err
		}
	}
	for _, f := range []string{"modules.builtin", "modules.builtin.modinfo", "modules.order"} {
		src := filepath.Join(a.Modules, f)
		if _, err := os.Stat(src); err != nil {
			continue
		}
		if err := putFile(root, File{Path: filepath.Join("/lib/modules", a.KernelVersion, f), Src: src}); err != nil {
			return err
		}
	}
	if out, err := exec.Command("depmod", "-b", root, a.KernelVersion).CombinedOutput(); err != nil {
		return fmt.Errorf("sysvm: depmod for %s: %v\n%s", dst, err, out)
	}
	return nil
}

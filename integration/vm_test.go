package integration

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/integration/vm"
	"github.com/elidisk/eli/internal/testtool"
)

//go:embed vm/guest.sh
var guestScript []byte

//go:embed vm/prelude.sh
var guestPrelude []byte

// vmKernel finds the kernel scripts/test caches: ELI_VM_DIR (default /var/cache/eli-vm)
// holds linux-VERSION/{vmlinuz,kernel/...}; the newest version wins.
func vmKernel(t *testing.T) (vmlinuz, modRoot string) {
	dir := os.Getenv("ELI_VM_DIR")
	if dir == "" {
		dir = "/var/cache/eli-vm"
	}
	found, _ := filepath.Glob(filepath.Join(dir, "linux-*", "vmlinuz"))
	if len(found) == 0 {
		testtool.Missing(t, "a Debian 6.1 kernel in "+dir+" (scripts/test fetches it)")
	}
	sort.Strings(found)
	k := filepath.Dir(found[len(found)-1])
	return filepath.Join(k, "vmlinuz"), filepath.Join(k, "kernel")
}

// TestVMKernelDevice boots Debian's 6.1 kernel under qemu (TCG) with eli in the
// initramfs, and checks what only a real /dev/nbdN shows: the block size the kernel
// uses, a filesystem on it, O_DIRECT, detach refused while the device is in use, fstrim
// reaching eli, a server killed with -9 while a file is written and replaced by a new
// 'eli attach' without the filesystem noticing, and the same for a planned restart
// ('detach --keep-device'). The guest (vm/guest.sh) reports; this
// test judges.
func TestVMKernelDevice(t *testing.T) {
	g := newGuest(t, guestScript, "")
	// A hang guard, not a timing assertion (the guest has its own, shorter one): a boot
	// and the whole script take about a minute under TCG on an idle machine.
	console, res := g.boot(t, "", 9*time.Minute)
	checkVMResults(t, res)
	// A request timed out before the crash sections (which time some out on purpose)
	// costs the run 30 s and fails nothing: its lines are kept to be seen.
	for _, line := range strings.Split(console, "\n") {
		if strings.Contains(line, "ELI-DIAG") || strings.Contains(line, "timed out") {
			t.Log(strings.TrimSpace(line))
		}
	}
	if t.Failed() {
		t.Logf("console:\n%s", tail(console, 6000))
		if log := serverLog(console); log != "" {
			t.Logf("the server's log when the kernel timed a request out:\n%s", log)
		}
	}
}

// guest is a bootable VM test: Debian's 6.1 kernel and an initramfs holding the guest
// script as /init, busybox, eli, e2fsprogs and the modules for nbd and ext4.
type guest struct {
	qemu, vmlinuz, initrd string
}

// newGuest builds the initramfs for script. extra names a Go package (a path relative to
// this directory) built into the guest as /bin/<its base name>, or "".
func newGuest(t *testing.T, script []byte, extra string) *guest {
	t.Helper()
	qemu := testtool.Need(t, "qemu-system-x86_64", "qemu-system-x86")
	busybox := testtool.Need(t, "busybox", "busybox-static")
	mkfs := testtool.Need(t, "mkfs.ext4", "e2fsprogs")
	fsck := testtool.Need(t, "e2fsck", "e2fsprogs")
	resize2fs := testtool.Need(t, "resize2fs", "e2fsprogs")
	vmlinuz, modRoot := vmKernel(t)
	dir := t.TempDir()

	var rd vm.Initramfs
	rd.File("init", script, 0o755)
	rd.File("lib/eli-prelude.sh", guestPrelude, 0o644)
	if err := rd.CopyFile("bin/busybox", busybox); err != nil {
		t.Fatal(err)
	}
	for _, applet := range []string{"sh", "mount", "insmod", "cat", "mkdir"} {
		rd.Symlink("bin/"+applet, "busybox")
	}
	rd.Dir("proc")
	rd.Dir("sys")
	rd.Dir("dev")
	// eli (and any test tool) must run without the host's libc.
	for _, pkg := range []string{"../cmd/eli", extra} {
		if pkg == "" {
			continue
		}
		name := filepath.Base(pkg)
		bin := filepath.Join(dir, name)
		build := exec.Command("go", "build", "-o", bin, pkg)
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", pkg, err, out)
		}
		if err := rd.CopyFile("bin/"+name, bin); err != nil {
			t.Fatal(err)
		}
	}
	for name, src := range map[string]string{"sbin/mkfs.ext4": mkfs, "sbin/e2fsck": fsck, "sbin/resize2fs": resize2fs} {
		if err := rd.CopyProgram(name, src); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat("/etc/mke2fs.conf"); err == nil {
		rd.CopyFile("etc/mke2fs.conf", "/etc/mke2fs.conf")
	}
	mods, err := vm.Resolve(modRoot, []string{"nbd", "crc32c_generic", "ext4"})
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, m := range mods {
		rd.CopyFile("lib/eli-modules/"+filepath.Base(m), m)
		order = append(order, filepath.Base(m))
	}
	rd.File("lib/eli-modules/order", []byte(strings.Join(order, "\n")+"\n"), 0o644)
	t.Logf("modules: %s", strings.Join(order, " "))

	initrd := filepath.Join(dir, "initrd.gz")
	f, err := os.Create(initrd)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rd.WriteTo(f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return &guest{qemu: qemu, vmlinuz: vmlinuz, initrd: initrd}
}

// boot runs the guest to its end, with args appended to the kernel's command line, and
// returns the console and the guest's results. limit is a hang guard: qemu is killed
// when it passes. A guest that does not report "done" fails the test.
func (g *guest) boot(t *testing.T, args string, limit time.Duration) (string, map[string][]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, g.qemu,
		"-accel", "tcg", "-m", "1536", "-smp", "2", "-nographic", "-no-reboot",
		"-kernel", g.vmlinuz, "-initrd", g.initrd,
		"-append", strings.TrimSpace("console=ttyS0 panic=-1 loglevel=4 rdinit=/init "+args))
	var console bytes.Buffer
	var w io.Writer = &console
	// ELI_VM_CONSOLE=FILE copies the console there as it comes, to watch a guest run.
	if path := os.Getenv("ELI_VM_CONSOLE"); path != "" {
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		w = io.MultiWriter(&console, f)
	}
	cmd.Stdout = w
	cmd.Stderr = w
	start := time.Now()
	runErr := cmd.Run()
	t.Logf("VM ran %v", time.Since(start).Round(time.Second))
	res := parseResults(console.Bytes())
	if _, ok := res["done"]; !ok || runErr != nil {
		t.Fatalf("guest did not finish (qemu: %v); console:\n%s", runErr, tail(console.String(), 6000))
	}
	if testing.Verbose() {
		for _, l := range strings.Split(console.String(), "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), "ELI-RESULT ") {
				t.Log(strings.TrimSpace(l))
			}
		}
	}
	return console.String(), res
}

// serverLog is what the guest printed of the server's log after the kernel timed a request
// out (guest.sh), or "".
func serverLog(console string) string {
	_, rest, ok := strings.Cut(console, "ELI-SERVER-LOG-BEGIN")
	if !ok {
		return ""
	}
	log, _, _ := strings.Cut(rest, "ELI-SERVER-LOG-END")
	return strings.TrimSpace(log)
}

// parseResults collects the guest's "ELI-RESULT key value..." lines; the kernel may
// interleave its own messages on the console, so only whole lines count.
func parseResults(out []byte) map[string][]string {
	res := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		rest, ok := strings.CutPrefix(line, "ELI-RESULT ")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		res[f[0]] = f[1:]
	}
	return res
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func checkVMResults(t *testing.T, res map[string][]string) {
	t.Helper()
	get := func(key string) string { return strings.Join(res[key], " ") }
	num := func(key string, i int) int64 {
		t.Helper()
		v := res[key]
		if len(v) <= i {
			t.Errorf("%s: no value %d in %q", key, i, v)
			return -1
		}
		n, err := strconv.ParseInt(v[i], 10, 64)
		if err != nil {
			t.Errorf("%s: %v", key, err)
		}
		return n
	}
	want := func(key, v string) {
		t.Helper()
		if got := get(key); got != v {
			t.Errorf("%s = %q, want %q", key, got, v)
		}
	}
	if v, ok := res["insmod_failed"]; ok {
		t.Errorf("insmod failed: %v", v)
	}
	if _, ok := res["watchdog"]; ok {
		t.Errorf("the guest's watchdog fired: a step hung")
	}
	// attach --device, and the geometry the kernel was given.
	for _, k := range []string{"init_rc", "attach_rc", "raw_direct_write_rc", "mkfs_rc", "mount_rc",
		"write_a_rc", "write_b_rc", "direct_write_rc", "umount_rc"} {
		want(k, "0")
	}
	ss := get("sector_size")
	want("logical_block_size", ss)
	if num("dev_size", 0) != num("eli_size", 0) || num("dev_size", 0) <= 0 {
		t.Errorf("kernel device size %s, eli serves %s", get("dev_size"), get("eli_size"))
	}
	want("max_sectors_kb", "1024") // nbdkernel.MaxSectorsKiB, below max_hw_sectors_kb
	if num("discard_max_bytes", 0) <= 0 {
		t.Errorf("discard_max_bytes %s: the kernel would not send TRIM", get("discard_max_bytes"))
	}
	want("raw_direct_cmp", "ok")
	want("fs_direct_cmp", "ok")

	// Detach refused while mounted or held; nothing lost; then one clean disconnect.
	if get("detach_mounted_rc") == "0" {
		t.Errorf("detach of a mounted device succeeded")
	}
	if m := get("detach_mounted_msg"); !strings.Contains(m, "mounted") {
		t.Errorf("detach of a mounted device said %q, want it to say it is mounted", m)
	}
	want("detach_mounted_server", "alive")
	want("sums_after_refusal", "ok")
	if get("detach_held_rc") == "0" {
		t.Errorf("detach of a device held open by a process succeeded")
	}
	if m := get("detach_held_msg"); !strings.Contains(m, "sleep") {
		t.Errorf("detach of a held device said %q, want it to name the process (sleep)", m)
	}
	want("detach_rc", "0")
	want("detach_dev", "unbound")
	want("detach_kernel_errors", "0")

	want("reattach_rc", "0")
	want("remount_rc", "0")
	want("sums_after_reattach", "ok")

	want("fstrim_rc", "0")
	if b, a := num("trim_blocks", 0), num("trim_blocks", 1); a >= b {
		t.Errorf("fstrim left the provider's allocation at %d blocks (was %d): TRIM did not reach eli", a, b)
	}

	// Crash and re-plug.
	want("crash_reattach_rc", "0")
	want("writer_rc", "0")
	want("writer_at", "95")
	want("crash_cmp_cached", "ok")
	// After the remount the file is read from eli, and it must be identical: attach
	// --device commits every write before acknowledging it, so the requests the kernel
	// re-sends to the new server (the FLUSH of an fsync in flight at the kill among them)
	// find every write the dead server acknowledged on the provider.
	if num("crash_log_size", 0) != 96*65536 {
		t.Errorf("crash file is %s bytes, want %d", get("crash_log_size"), 96*65536)
	}
	if get("crash_cmp") != "ok" {
		t.Errorf("the crash file differs after the re-plug, in 64 KiB pieces %v (the kill came after piece %s)",
			res["crash_diff_pieces"], get("killed_at"))
	}
	want("crash_old_files_ok", "2") // b and direct (a was removed for fstrim)
	want("crash_kernel_errors", "0")
	if num("crash_reconnected", 0) < 1 {
		t.Errorf("the kernel logged no reconnected socket")
	}

	// Restart without unmounting.
	want("keep_detach_rc", "0")
	want("keep_dev", "bound")
	want("keep_attach_rc", "0")
	want("keep_writer_rc", "0")
	want("keep_cmp", "ok")
	want("keep_crash_file", "ok")
	want("keep_kernel_errors", "0")
	if num("keep_reconnected", 0) < 1 {
		t.Errorf("the kernel logged no reconnected socket after the restart")
	}

	// Resizing an attached volume is refused, and the device keeps its size; through a
	// restart (detach --keep-device, resize, attach) the mounted device grows.
	if get("resize_rc") == "0" || !strings.Contains(get("resize_msg"), "attached") {
		t.Errorf("resize of an attached volume: rc %s, %q; want a refusal naming it attached", get("resize_rc"), get("resize_msg"))
	}
	if v := res["resize_dev_size"]; len(v) != 2 || v[0] != v[1] {
		t.Errorf("device size changed across a refused resize: %v", v)
	}
	for _, k := range []string{"grow_keep_rc", "grow_resize_rc", "grow_attach_rc", "grow_resize2fs_rc", "grow_write_rc"} {
		want(k, "0")
	}
	if before, after := num("grow_dev_size", 0), num("grow_dev_size", 1); after <= before || after != num("grow_eli_size", 0) {
		t.Errorf("device size %d -> %d across the grow, eli serves %s", before, after, get("grow_eli_size"))
	}
	if before, after := num("grow_fs_kb", 0), num("grow_fs_kb", 1); after <= before {
		t.Errorf("filesystem size %d KiB -> %d KiB after resize2fs", before, after)
	}
	want("grow_old_files_ok", "2")

	want("final_detach_rc", "0")
	want("fsck_rc", "0")
	want("force_detach_rc", "0")
	want("force_dev", "disconnected")
	want("force_server", "gone")

	// attach --foreground --device auto, as a generated unit runs it: the device named
	// /dev/eli/svc; stopped with its file system mounted, the device stays for the next
	// server, which re-plugs it; stopped unmounted, it is disconnected and unnamed.
	if !strings.HasPrefix(get("svc_link"), "../nbd") {
		t.Errorf("/dev/eli/svc -> %q, want ../nbdN", get("svc_link"))
	}
	for _, k := range []string{"svc_mount_rc", "svc_busy_stop_rc", "svc_restart_write_rc", "svc_kernel_errors", "svc_idle_stop_rc"} {
		want(k, "0")
	}
	want("svc_busy_dev", "bound")
	want("svc_busy_link", get("svc_link"))
	want("svc_restart_link", get("svc_link"))
	want("svc_restart_file", "ok")
	want("svc_idle_dev", "unbound")
	want("svc_idle_link", "none")
	want("svc_busy_log", "1")
	if num("svc_reconnected", 0) < 1 {
		t.Errorf("the kernel logged no reconnected socket after the service's restart")
	}
	want("svc_server", "gone")
}

package integration

import (
	"context"
	"math/rand/v2"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/integration/sysvm"
	"github.com/elidisk/eli/internal/testtool"
)

// TestSysVMPowerCut is sysvm's smoke test on a plain ext4 data disk (no eli): a Debian
// 12 guest with systemd as PID 1 boots from a disk that loses what it was not told to
// flush; a file written and fsynced survives a clean reboot (the data disk mounted from
// fstab at boot, the previous boot's journal readable) and then a power cut in the
// middle of writes, after which the file system was recovered from its journal, mounts
// and is clean for e2fsck; a clean power-off leaves nothing unflushed.
func TestSysVMPowerCut(t *testing.T) {
	fsck := testtool.Need(t, "e2fsck", "e2fsprogs")
	m := sysvm.NewTest(t, sysvm.TestOptions{Disks: []sysvm.DiskSpec{{Name: "data", Size: 256 << 20}}})
	data := m.Disk("data")
	// A hang guard, not a timing assertion: four boots take a few minutes under TCG.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	g := sysGuest{t, m, ctx}
	run, boot := g.run, g.boot

	boot()
	t.Logf("boot 1: %s", run("systemd-analyze"))
	if got := run("readlink /proc/1/exe"); got != "/usr/lib/systemd/systemd" {
		t.Errorf("PID 1 is %s, want systemd", got)
	}
	run(`mkfs.ext4 -q -L data /dev/disk/by-id/virtio-data
mkdir /data
echo '/dev/disk/by-id/virtio-data /data ext4 defaults 0 2' >>/etc/fstab
systemctl daemon-reload
systemctl start data.mount`)
	flushes := data.Stats().Flushes
	sumA := run(`head -c 4M /dev/urandom >/data/a && sync /data/a && sha256sum /data/a`)
	if data.Stats().Flushes == flushes {
		t.Fatalf("sync in the guest sent no flush to the data disk")
	}

	// A clean reboot: the file system is unmounted, the disk keeps its cache (the
	// power stays on), fstab mounts it at the next boot.
	g.reboot()
	if run("systemctl is-active data.mount") != "active" {
		t.Fatalf("fstab did not mount /data at boot")
	}
	if got := run("sha256sum /data/a"); got != sumA {
		t.Fatalf("after a clean reboot: %s, want %s", got, sumA)
	}
	if n := run("journalctl --list-boots | grep -cE '^ *-?[0-9]+ '"); n != "2" {
		t.Errorf("journalctl --list-boots lists %s boots, want 2 (a persistent journal)", n)
	}
	if got := run("journalctl -b -1 -o cat -u data.mount --no-pager"); !strings.Contains(got, "Unmounted data.mount") {
		t.Errorf("journalctl -b -1 does not show /data unmounted at the reboot:\n%s", got)
	}

	// A power cut in the middle of writes: b is written without sync, c with O_DIRECT
	// (written to the disk, never flushed) until the cut. The cut comes once the data
	// disk holds unflushed writes, and loses, keeps or tears each of them.
	run(`head -c 8M /dev/urandom >/data/b
(while :; do dd if=/dev/urandom of=/data/c bs=64k count=64 oflag=direct conv=notrunc status=none; done) >/dev/null 2>&1 &`)
	seed := uint64(time.Now().UnixNano())
	t.Logf("power cut: lose-random, seed %d", seed)
	cut, err := m.PowerCutWhen(ctx, func(unflushed map[string]int) bool { return unflushed["data"] >= 16 },
		sysvm.LoseRandom, rand.New(rand.NewPCG(seed, 0)))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("power cut: %+v", cut)
	if cut["data"].Writes == 0 {
		t.Fatalf("the power cut found no unflushed write on the data disk: %+v", cut["data"])
	}

	boot()
	if run("systemctl is-active data.mount") != "active" {
		t.Fatalf("/data is not mounted after the power cut")
	}
	// fstab's pass number 2 has systemd-fsck run e2fsck, which replays the journal
	// before the mount; without it the kernel would.
	if got := run("journalctl -b -o cat -u 'systemd-fsck@*' --no-pager; dmesg | grep 'EXT4-fs (vdb)'"); !strings.Contains(got, "recovering journal") && !strings.Contains(got, "recovery complete") {
		t.Errorf("nothing recovered /data's journal after the power cut:\n%s", got)
	}
	if got := run("sha256sum /data/a"); got != sumA {
		t.Fatalf("after a power cut: %s, want %s", got, sumA)
	}
	t.Logf("b after the cut: %s", run("stat -c '%s bytes' /data/b 2>&1 || true"))
	r, err := m.Run(ctx, "umount /data && e2fsck -fn /dev/vdb")
	if err != nil {
		t.Fatal(err)
	}
	if r.RC != 0 {
		t.Errorf("e2fsck -fn of /data after the power cut: %s", r)
	}

	// A clean power-off flushes everything: a cut after it loses nothing, and both file
	// systems are clean on the host.
	if err := m.Poweroff(ctx); err != nil {
		t.Fatal(err)
	}
	cut, err = m.PowerCut(sysvm.LoseAll, nil)
	if err != nil {
		t.Fatal(err)
	}
	for name, st := range cut {
		if st.Writes != 0 {
			t.Errorf("disk %s held %d unflushed writes after a clean power-off", name, st.Writes)
		}
	}
	for _, d := range []*sysvm.Disk{m.Disk("root"), data} {
		if out, err := exec.Command(fsck, "-fn", d.Path()).CombinedOutput(); err != nil {
			t.Errorf("e2fsck -fn %s after a clean power-off: %v\n%s", d.Path(), err, out)
		}
	}
}

// sysGuest runs a test's steps on a sysvm machine, failing the test when one fails.
type sysGuest struct {
	t   *testing.T
	m   *sysvm.Machine
	ctx context.Context
}

// run runs script in the guest and returns its standard output, trimmed; a script that
// fails fails the test.
func (g sysGuest) run(script string) string {
	g.t.Helper()
	r, err := g.m.Run(g.ctx, script)
	if err != nil {
		g.t.Fatal(err)
	}
	if r.RC != 0 {
		// What the units said: a failed start of a volume's service is in its journal.
		units := "(the units' journal could not be read)"
		if j, err := g.m.Run(g.ctx, "systemctl --no-pager --failed; journalctl -b --no-pager -o short-monotonic -u 'eli@*' -u 'nbdkit-eli*' | tail -120"); err == nil {
			units = string(j.Stdout)
		}
		g.t.Fatalf("guest script failed: %s\nscript:\n%s\nunits:\n%s", r, script, units)
	}
	return strings.TrimSpace(string(r.Stdout))
}

// boot boots the machine and requires every unit to have started.
func (g sysGuest) boot() {
	g.t.Helper()
	g.check(g.m.Boot(g.ctx))
}

// reboot reboots the machine cleanly and requires every unit to have started. A
// shutdown that hangs (a stop job with no time limit) fails the test after a bound far
// above a slow boot's, with the console that shows what it waited for.
func (g sysGuest) reboot() {
	g.t.Helper()
	ctx, cancel := context.WithTimeout(g.ctx, 8*time.Minute)
	defer cancel()
	g.check(g.m.Reboot(ctx))
}

func (g sysGuest) check(info sysvm.BootInfo, err error) {
	g.t.Helper()
	if err != nil {
		g.t.Fatal(err)
	}
	if info.State != "running" {
		g.t.Fatalf("boot %d: system %s:\n%s", g.m.Boots(), info.State,
			g.run("systemctl --failed --no-legend; journalctl -b -p warning --no-pager | tail -50"))
	}
}

package integration

import (
	"context"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/integration/sysvm"
	"github.com/elidisk/eli/internal/testtool"
)

// nbdkitSocket and nbdkitService serve the _netdev volume's provider inside the guest,
// socket-activated so that the port listens from the moment the socket unit starts.
const nbdkitSocket = `[Unit]
Description=NBD export of the remote eli volume's provider (test)

[Socket]
ListenStream=10809

[Install]
WantedBy=sockets.target
`

const nbdkitService = `[Unit]
Description=NBD export of the remote eli volume's provider (test)

[Service]
ExecStart=/usr/bin/nbdkit --foreground file /var/lib/eli-test/remote.img
`

// TestSysVMAttachAtBoot is issue 37's boot test: Debian 12 with systemd, the eli
// package installed with dpkg -i, three volumes in /etc/elitab (a keyfile, a systemd
// credential, and a _netdev one over an NBD export that nbdkit serves inside the guest)
// mounted from fstab at boot; files survive a clean reboot, in which every volume
// detached after its unmount; a power cut mid-write is followed by a boot that recovers,
// mounts, and leaves every file system clean for e2fsck. It logs boot-to-mounted times
// with and without the volumes.
func TestSysVMAttachAtBoot(t *testing.T) {
	testtool.Need(t, "dpkg-deb", "dpkg")
	debDir := t.TempDir()
	build := exec.Command("../scripts/deb", debDir)
	build.Env = append(os.Environ(), "ELI_VERSION=0~sysvm")
	out, err := build.Output()
	if err != nil {
		t.Fatalf("scripts/deb: %v", err)
	}
	deb := strings.TrimSpace(string(out))
	if _, err := os.Stat(deb); err != nil || filepath.Ext(deb) != ".deb" {
		t.Fatalf("scripts/deb printed %q: %v", deb, err)
	}
	m := sysvm.NewTest(t, sysvm.TestOptions{
		Disks:   []sysvm.DiskSpec{{Name: "vol1", Size: 256 << 20}, {Name: "vol2", Size: 256 << 20}},
		Network: true,
		Root: sysvm.RootOptions{Files: []sysvm.File{
			{Path: "/root/eli.deb", Src: deb},
			{Path: "/etc/systemd/system/nbdkit-eli.socket", Data: []byte(nbdkitSocket)},
			{Path: "/etc/systemd/system/nbdkit-eli.service", Data: []byte(nbdkitService)},
		}},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	g := sysGuest{t, m, ctx}
	run := g.run
	vols := []string{"data", "home", "remote"}
	mounts := []string{"mnt-data.mount", "mnt-home.mount", "mnt-remote.mount"}

	// Boot 1, without eli: the baseline, then the setup.
	g.boot()
	base, err := m.UnitTimes(ctx, "local-fs.target", "remote-fs.target", "multi-user.target")
	if err != nil {
		t.Fatal(err)
	}
	run(`set -e
dpkg -i /root/eli.deb
install -d -m 700 /etc/eli /etc/credstore.encrypted
install -d /var/lib/eli-test
for k in /etc/eli/data.key /etc/eli/remote.key /root/home.key; do head -c 64 /dev/urandom >$k; chmod 600 $k; done
kdf="--kdf-memory 64 --kdf-time 1"
eli init $kdf -p -k /etc/eli/data.key /dev/disk/by-id/virtio-vol1
eli init $kdf -p -k /root/home.key /dev/disk/by-id/virtio-vol2
systemd-creds encrypt --name=home.key /root/home.key /etc/credstore.encrypted/home.key
shred -u /root/home.key
truncate -s 256M /var/lib/eli-test/remote.img
systemctl enable --now nbdkit-eli.socket
eli init $kdf -p -k /etc/eli/remote.key nbd://10.0.2.15:10809/
cat >/etc/elitab <<'EOF'
data    /dev/disk/by-id/virtio-vol1  /etc/eli/data.key
home    /dev/disk/by-id/virtio-vol2  cred-encrypted:home.key
remote  nbd://10.0.2.15:10809/       /etc/eli/remote.key      _netdev,x-systemd.requires=nbdkit-eli.socket,x-systemd.after=nbdkit-eli.service
EOF
eli elitab
systemctl daemon-reload
systemctl start eli.target remote-eli.target
udevadm settle
for v in data home remote; do mkfs.ext4 -q -L $v /dev/eli/$v; mkdir -p /mnt/$v; done
cat >>/etc/fstab <<'EOF'
/dev/eli/data    /mnt/data    ext4  defaults  0 2
/dev/eli/home    /mnt/home    ext4  defaults  0 2
/dev/eli/remote  /mnt/remote  ext4  _netdev   0 2
EOF
systemctl daemon-reload`)

	// Boot 2: the volumes attach and mount at boot; files are written and synced.
	g.reboot()
	for _, u := range mounts {
		if got := run("systemctl is-active " + u); got != "active" {
			t.Fatalf("%s is %s after boot", u, got)
		}
	}
	withEli, err := m.UnitTimes(ctx, append([]string{"local-fs.target", "remote-fs.target", "multi-user.target", "network-online.target"}, mounts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("boot to local-fs.target: %v without eli volumes, %v with two; to remote-fs.target: %v without, %v with the _netdev one",
		base["local-fs.target"].Round(time.Millisecond), withEli["local-fs.target"].Round(time.Millisecond),
		base["remote-fs.target"].Round(time.Millisecond), withEli["remote-fs.target"].Round(time.Millisecond))
	t.Logf("mounted at: %v", withEli)
	// _netdev: the remote volume's service started once the network was online.
	if start := run("systemctl show -P InactiveExitTimestampMonotonic eli@remote.service"); start == "" || start == "0" {
		t.Errorf("eli@remote.service never started")
	} else if d, _ := time.ParseDuration(start + "us"); d < withEli["network-online.target"] {
		t.Errorf("eli@remote.service started at %v, before network-online.target (%v)", d, withEli["network-online.target"])
	}
	sums := run(`set -e
for v in data home remote; do head -c 4M /dev/urandom >/mnt/$v/a; done
sync
sha256sum /mnt/*/a`)

	// Boot 3, after a clean reboot: every file intact, and the previous boot's journal
	// shows each volume detached after its file system was unmounted, with nothing
	// busy, no I/O error and no stop job that ran out its time.
	g.reboot()
	if got := run("sha256sum /mnt/*/a"); got != sums {
		t.Fatalf("after a clean reboot:\n%s\nwant\n%s", got, sums)
	}
	journal := run("journalctl -b -1 -o cat --no-pager")
	lines := strings.Split(journal, "\n")
	index := func(re string) int {
		r := regexp.MustCompile(re)
		for i, l := range lines {
			if r.MatchString(l) {
				return i
			}
		}
		return -1
	}
	for i, v := range vols {
		unmounted := index(`^Unmounted ` + regexp.QuoteMeta(mounts[i]))
		stopped := index(`^Stopped eli@` + v + `\.service`)
		switch {
		case unmounted < 0 || stopped < 0:
			t.Errorf("volume %s: the previous boot's journal lacks its unmount (%d) or its stop (%d)", v, unmounted, stopped)
		case stopped < unmounted:
			t.Errorf("volume %s: stopped before its file system was unmounted", v)
		}
	}
	for _, bad := range []string{`(?i)busy`, `I/O error`, `State 'stop[a-z-]*' timed out`, `Failed with result`} {
		if i := index(bad); i >= 0 {
			t.Errorf("the previous boot's journal says %q", lines[i])
		}
	}
	if n := strings.Count(journal, "Connection timed out, retrying"); n > 0 {
		// The kernel waited out its 30 s request timeout; it retries, so nothing fails,
		// but the boot is that much slower.
		t.Logf("the previous boot's kernel timed out %d NBD requests", n)
	}
	if t.Failed() {
		t.Fatalf("the previous boot's journal (end):\n%s", tailLines(journal, 120))
	}

	// A power cut while a file is written to each volume with O_DIRECT: a few seconds
	// into the writes, at a moment when both local volumes' disks hold unflushed writes.
	run(`for v in data home remote; do
	(while :; do dd if=/dev/urandom of=/mnt/$v/c bs=64k count=64 oflag=direct conv=notrunc status=none; done) >/dev/null 2>&1 &
done`)
	seed := uint64(time.Now().UnixNano())
	t.Logf("power cut: lose-random, seed %d", seed)
	writing := time.Now()
	cut, err := m.PowerCutWhen(ctx, func(u map[string]int) bool {
		return time.Since(writing) > 3*time.Second && u["vol1"] > 0 && u["vol2"] > 0
	}, sysvm.LoseRandom, rand.New(rand.NewPCG(seed, 0)))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("power cut: %+v", cut)

	// Boot 4: the volumes attach and their file systems mount (journal recovered), the
	// files synced before are intact, and e2fsck finds nothing wrong.
	g.boot()
	for _, u := range mounts {
		if got := run("systemctl is-active " + u); got != "active" {
			t.Fatalf("%s is %s after the power cut", u, got)
		}
	}
	if got := run("sha256sum /mnt/*/a"); got != sums {
		t.Fatalf("after the power cut:\n%s\nwant\n%s", got, sums)
	}
	t.Logf("after the power cut: %s", run("journalctl -b -o cat --no-pager -u 'systemd-fsck@*' -u 'eli@*' | grep -i -E 'recover|clean' || true"))
	for i, v := range vols {
		r, err := m.Run(ctx, "umount /mnt/"+v+" && e2fsck -fn /dev/eli/"+v)
		if err != nil {
			t.Fatal(err)
		}
		if r.RC != 0 {
			t.Errorf("e2fsck -fn of volume %s after the power cut: %s", v, r)
		}
		run("systemctl start " + mounts[i])
	}
}

func tailLines(s string, n int) string {
	l := strings.Split(s, "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// Package ceph brings up a one-node Ceph cluster on 127.0.0.1 for eli's integration
// tests, by hand in the manner of Ceph's vstart.sh and its manual deployment guide: one
// monitor made with monmaptool and ceph-mon --mkfs, one BlueStore OSD on a sparse file,
// cephx, pools of one replica, and no manager (RADOS and RBD I/O do not need one). RBD
// images are exported as the README tells users to: qemu-nbd's rbd driver on a unix
// socket, as a cephx client limited to the rbd profile.
//
// Everything lives in a directory the caller owns. The daemons run in the foreground as
// children of the test process, which kill them when the test ends, and the kernel
// kills them if the test process dies first.
package ceph

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// commandTimeout bounds every ceph, rados and rbd command: they wait for the monitor
// or an OSD without end when those are gone, and a test must fail instead of hang.
const commandTimeout = 2 * time.Minute

// startTimeout bounds a daemon's start (a monitor in quorum, an OSD active).
const startTimeout = 2 * time.Minute

// Need stops the test unless every program the cluster uses is installed, naming the
// Debian packages that provide them.
func Need(t testing.TB) {
	t.Helper()
	for _, p := range [][2]string{
		{"ceph-mon", "ceph-mon"}, {"ceph-osd", "ceph-osd"}, {"monmaptool", "ceph-base"},
		{"ceph-authtool", "ceph-common"}, {"ceph", "ceph-common"}, {"rados", "ceph-common"},
		{"rbd", "ceph-common"}, {"qemu-nbd", "qemu-utils"},
	} {
		testtool.Need(t, p[0], p[1])
	}
	// qemu's rbd driver is a module of its own.
	if m, _ := filepath.Glob("/usr/lib/*/qemu/block-rbd.so"); len(m) == 0 {
		testtool.Missing(t, "qemu's rbd driver (Debian package qemu-block-extra)")
	}
}

// Cluster is a running one-node cluster.
type Cluster struct {
	dir  string
	conf string // ceph.conf, which names the admin keyring
	mu   sync.Mutex
	mon  *daemon
	osd  *daemon
	// osdPeak is the highest peak resident memory of the OSD processes killed so far.
	osdPeak int64
	osdID   string
	// ClientKeyring holds the key of client.eli, allowed the rbd profile on every pool:
	// what a gateway host gets.
	ClientKeyring string
}

// ClientID is the cephx name (without "client.") that gateways use.
const ClientID = "eli"

// Start bootstraps a cluster in dir and stops it when the test ends.
func Start(t testing.TB, dir string) *Cluster {
	t.Helper()
	Need(t)
	c := &Cluster{dir: dir}
	t.Cleanup(c.stop)
	for _, d := range []string{"run", "log", "mon", "osd"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	port := freePort(t)
	fsid := uuid(t)
	c.conf = filepath.Join(dir, "ceph.conf")
	admin := filepath.Join(dir, "admin.keyring")
	// The settings, from Ceph's configuration reference: one node, so no failure domain
	// above the OSD and one replica (which the monitor allows only when told); a full
	// disk on a CI machine must not stop the monitor; RocksDB's chatter out of the OSD's
	// log; the OSD's caches kept small.
	conf := fmt.Sprintf(`[global]
fsid = %[1]s
mon host = v2:127.0.0.1:%[2]d
public addr = 127.0.0.1
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
keyring = %[3]s/admin.keyring
run dir = %[3]s/run
admin socket = %[3]s/run/$name.asok
log file = %[3]s/log/$name.log
osd pool default size = 1
osd pool default min size = 1
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
debug rocksdb = 0/0
debug bluefs = 0/0
[client]
admin socket = %[3]s/run/$name.$pid.asok
log file = %[3]s/log/$name.$pid.log
[mon]
mon data = %[3]s/mon/$id
[osd]
osd data = %[3]s/osd/$id
keyring = %[3]s/osd/$id/keyring
osd objectstore = bluestore
bluestore block path = %[3]s/osd/block.$id
bluestore block create = true
bluestore block size = 4294967296
bluestore block db create = false
bluestore block wal create = false
osd memory target = 1073741824
`, fsid, port, dir)
	if err := os.WriteFile(c.conf, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	began := time.Now()

	// The monitor: its own key and the admin's in one keyring, a monmap that names it,
	// and a store made from both.
	keyring := fmt.Sprintf("[mon.]\n\tkey = %s\n\tcaps mon = \"allow *\"\n"+
		"[client.admin]\n\tkey = %s\n\tcaps mon = \"allow *\"\n\tcaps osd = \"allow *\"\n\tcaps mgr = \"allow *\"\n",
		c.genKey(t), c.genKey(t))
	if err := os.WriteFile(admin, []byte(keyring), 0o600); err != nil {
		t.Fatal(err)
	}
	monmap := filepath.Join(dir, "monmap")
	c.tool(t, "monmaptool", "--create", "--fsid", fsid, "--addv", "a", fmt.Sprintf("[v2:127.0.0.1:%d]", port), monmap)
	c.tool(t, "ceph-mon", "-c", c.conf, "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", admin)
	c.mon = c.startDaemon(t, "ceph-mon", "-f", "-c", c.conf, "-i", "a")
	c.waitAsok(t, c.mon, "mon.a", "mon_status", "leader")

	// The OSD: the monitor allots its id for a key made here, ceph-osd --mkfs makes its
	// BlueStore on the sparse file, and its keyring holds the same key.
	osdUUID := uuid(t)
	key := c.genKey(t)
	secret, _ := json.Marshal(map[string]string{"cephx_secret": key})
	c.osdID = strings.TrimSpace(c.runIn(t, secret, "ceph", "osd", "new", osdUUID, "-i", "-"))
	if c.osdID != "0" {
		t.Fatalf("ceph osd new gave id %q, want 0", c.osdID)
	}
	if err := os.Mkdir(filepath.Join(dir, "osd", c.osdID), 0o700); err != nil {
		t.Fatal(err)
	}
	c.tool(t, "ceph-osd", "-c", c.conf, "-i", c.osdID, "--mkfs", "--key", key, "--osd-uuid", osdUUID)
	okeyring := fmt.Sprintf("[osd.%s]\n\tkey = %s\n", c.osdID, key)
	if err := os.WriteFile(filepath.Join(dir, "osd", c.osdID, "keyring"), []byte(okeyring), 0o600); err != nil {
		t.Fatal(err)
	}
	c.StartOSD(t)

	// A gateway host's credentials: the rbd profile, nothing more.
	caps := c.Run(t, "ceph", "auth", "get-or-create", "client."+ClientID, "mon", "profile rbd", "osd", "profile rbd")
	c.ClientKeyring = filepath.Join(dir, ClientID+".keyring")
	if err := os.WriteFile(c.ClientKeyring, []byte(caps), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("ceph: a monitor on 127.0.0.1:%d and osd.0 up in %v", port, time.Since(began).Round(time.Millisecond))
	return c
}

// Run runs a Ceph command-line tool (ceph, rados, rbd) as client.admin and returns its
// standard output, failing the test unless it succeeds.
func (c *Cluster) Run(t testing.TB, prog string, args ...string) string {
	t.Helper()
	return c.runIn(t, nil, prog, args...)
}

func (c *Cluster) runIn(t testing.TB, stdin []byte, prog string, args ...string) string {
	t.Helper()
	out, err := run(stdin, prog, append([]string{"-c", c.conf}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tool runs a program that takes its configuration on the command line.
func (c *Cluster) tool(t testing.TB, prog string, args ...string) string {
	t.Helper()
	out, err := run(nil, prog, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func run(stdin []byte, prog string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, prog, args...)
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %w\n%s%s", prog, strings.Join(args, " "), err, out.String(), errb.String())
	}
	return out.String(), nil
}

// genKey makes a cephx secret.
func (c *Cluster) genKey(t testing.TB) string {
	t.Helper()
	return strings.TrimSpace(c.tool(t, "ceph-authtool", "--gen-print-key"))
}

// CreatePool creates a replicated pool of one replica for RBD images.
func (c *Cluster) CreatePool(t testing.TB, name string) {
	t.Helper()
	c.Run(t, "ceph", "osd", "pool", "create", name, "8", "8", "replicated", "--size", "1")
	c.Run(t, "ceph", "osd", "pool", "application", "enable", name, "rbd")
}

// ImageFeatures are the features of the images CreateImage makes: exclusive-lock (the
// README's advice) and the object map that builds on it, as Ceph's defaults have them.
const ImageFeatures = "layering,exclusive-lock,object-map,fast-diff"

// CreateImage creates an RBD image of size bytes.
func (c *Cluster) CreateImage(t testing.TB, pool, name string, size int64) {
	t.Helper()
	c.Run(t, "rbd", "create", "--size", strconv.FormatInt(size>>20, 10)+"M", "--image-feature", ImageFeatures, pool+"/"+name)
}

// Objects returns every object of pool with its data: what RADOS stores, read past
// every gateway.
func (c *Cluster) Objects(t testing.TB, pool string) map[string][]byte {
	t.Helper()
	objs := make(map[string][]byte)
	tmp := filepath.Join(c.dir, "object")
	for _, name := range strings.Fields(c.Run(t, "rados", "-p", pool, "ls")) {
		c.Run(t, "rados", "-p", pool, "get", name, tmp)
		b, err := os.ReadFile(tmp)
		if err != nil {
			t.Fatal(err)
		}
		objs[name] = b
	}
	os.Remove(tmp)
	return objs
}

// SetWatchTimeout sets the OSD's osd_client_watch_timeout in the monitor's
// configuration database, as the README advises (0: Ceph's default). It is how long the
// watch of a client that died without closing its image, and so the RBD exclusive lock
// it held, outlives it; a watch keeps the timeout it was made with, so it applies to
// gateways started after it.
func (c *Cluster) SetWatchTimeout(t testing.TB, d time.Duration) {
	t.Helper()
	if d == 0 {
		c.Run(t, "ceph", "config", "rm", "osd", "osd_client_watch_timeout")
		return
	}
	c.Run(t, "ceph", "config", "set", "osd", "osd_client_watch_timeout", strconv.Itoa(int(d.Round(time.Second)/time.Second)))
}

// KillOSD kills the OSD with sig and waits for it to exit.
func (c *Cluster) KillOSD(sig syscall.Signal) {
	c.mu.Lock()
	d := c.osd
	c.osd = nil
	if d != nil {
		c.osdPeak = max(c.osdPeak, d.peakRSS())
	}
	c.mu.Unlock()
	d.kill(sig)
}

// StartOSD starts the OSD and waits until it is active (booted and in the map).
func (c *Cluster) StartOSD(t testing.TB) {
	t.Helper()
	d := c.startDaemon(t, "ceph-osd", "-f", "-c", c.conf, "-i", c.osdID)
	c.mu.Lock()
	c.osd = d
	c.mu.Unlock()
	// "active": booted and marked up in the OSD map.
	c.waitAsok(t, d, "osd."+c.osdID, "status", "active")
}

// waitAsok waits until the daemon name's admin socket, which answers without the
// monitor, reports state want to cmd.
func (c *Cluster) waitAsok(t testing.TB, d *daemon, name, cmd, want string) {
	t.Helper()
	asok := filepath.Join(c.dir, "run", name+".asok")
	deadline := time.Now().Add(startTimeout)
	for {
		out, err := run(nil, "ceph", "--admin-daemon", asok, cmd)
		var st struct {
			State string `json:"state"`
		}
		if err == nil && json.Unmarshal([]byte(out), &st) == nil && st.State == want {
			return
		}
		if d.exited() {
			t.Fatalf("%s exited at start:\n%s\n%s", name, d.output(), tail(c.Log(name)))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not %s within %v:\n%s", name, want, startTimeout, tail(c.Log(name)))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Log is the log of a daemon (mon.a, osd.0) or client, for failure messages.
func (c *Cluster) Log(name string) string {
	b, err := os.ReadFile(filepath.Join(c.dir, "log", name+".log"))
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return string(b)
}

// PeakRSS is the peak resident memory of the monitor and of the OSD (the most any of
// its processes reached), in bytes.
func (c *Cluster) PeakRSS() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	osd := c.osdPeak
	if c.osd != nil {
		osd = max(osd, c.osd.peakRSS())
	}
	return c.mon.peakRSS() + osd
}

// DiskUsage is what the OSD's sparse file takes on disk, in bytes.
func (c *Cluster) DiskUsage() int64 {
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(c.dir, "osd", "block."+c.osdID), &st); err != nil {
		return 0
	}
	return st.Blocks * 512
}

func (c *Cluster) stop() {
	c.mu.Lock()
	ds := []*daemon{c.osd, c.mon}
	c.osd, c.mon = nil, nil
	c.mu.Unlock()
	for _, d := range ds {
		if d != nil {
			d.kill(syscall.SIGKILL)
		}
	}
}

// Gateway is qemu-nbd serving one RBD image on a unix socket, restartable on the same
// socket.
type Gateway struct {
	c    *Cluster
	args []string
	// Sock is the unix socket; URI names it for eli.
	Sock, URI string
	mu        sync.Mutex
	d         *daemon
}

// Gateway exports pool/image through qemu-nbd as client.eli, on a unix socket in sockDir,
// and stops it when the test ends.
func (c *Cluster) Gateway(t testing.TB, pool, image, sockDir string) *Gateway {
	t.Helper()
	g := &Gateway{c: c, Sock: filepath.Join(sockDir, image+".sock")}
	g.URI = "nbd+unix:///?socket=" + g.Sock
	// As the README: raw, no cache in qemu (a flush must reach RADOS), several clients.
	g.args = []string{"--format=raw", "--cache=none", "--persistent", "--shared=8", "-k", g.Sock,
		fmt.Sprintf("rbd:%s/%s:conf=%s:id=%s:keyring=%s", pool, image, c.conf, ClientID, c.ClientKeyring)}
	g.Start(t)
	t.Cleanup(func() { g.Kill(syscall.SIGKILL) })
	return g
}

// Start starts qemu-nbd and waits until it listens.
func (g *Gateway) Start(t testing.TB) {
	t.Helper()
	os.Remove(g.Sock) // a killed qemu-nbd leaves it
	d := g.c.startDaemon(t, "qemu-nbd", g.args...)
	g.mu.Lock()
	g.d = d
	g.mu.Unlock()
	deadline := time.Now().Add(startTimeout)
	for {
		if conn, err := net.Dial("unix", g.Sock); err == nil {
			conn.Close()
			return
		}
		if d.exited() {
			t.Fatalf("qemu-nbd exited at start:\n%s", d.output())
		}
		if time.Now().After(deadline) {
			t.Fatalf("qemu-nbd not listening on %s within %v:\n%s", g.Sock, startTimeout, d.output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Kill sends sig to qemu-nbd and waits for it to exit (SIGTERM: it closes the image
// and gives up its lock; SIGKILL: the lock outlives it until the OSD drops its watch).
func (g *Gateway) Kill(sig syscall.Signal) {
	g.mu.Lock()
	d := g.d
	g.d = nil
	g.mu.Unlock()
	d.kill(sig)
}

// PeakRSS is the peak resident memory of the qemu-nbd process running now, in bytes.
func (g *Gateway) PeakRSS() int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.d.peakRSS()
}

// daemon is one child process in the foreground, its output kept for failures.
type daemon struct {
	cmd  *exec.Cmd
	out  string // the file its standard output and error go to
	done chan struct{}
}

func (c *Cluster) startDaemon(t testing.TB, prog string, args ...string) *daemon {
	t.Helper()
	cmd := exec.Command(prog, args...)
	// Killed with the test process, however it ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	// Appended to across restarts, beside the daemons' own logs.
	d := &daemon{cmd: cmd, out: filepath.Join(c.dir, "log", filepath.Base(prog)+".out"), done: make(chan struct{})}
	f, err := os.OpenFile(d.out, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close() // the child has its own copy
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		cmd.Wait()
		close(d.done)
	}()
	return d
}

func (d *daemon) exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

func (d *daemon) kill(sig syscall.Signal) {
	if d == nil {
		return
	}
	d.cmd.Process.Signal(sig)
	<-d.done
}

func (d *daemon) output() string {
	b, err := os.ReadFile(d.out)
	if err != nil {
		return fmt.Sprintf("(no output: %v)", err)
	}
	return tail(string(b))
}

// peakRSS is the process's VmHWM (/proc/PID/status) in bytes, 0 once it is gone.
func (d *daemon) peakRSS() int64 {
	if d == nil {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", d.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmHWM:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// freePort is a TCP port on 127.0.0.1 that nothing listens on now. The monitor binds
// it a moment later; the OSD takes its own ports from Ceph's range, skipping used ones.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func uuid(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/kernel/random/uuid")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// tail is the end of a log, enough to see why a daemon stopped.
func tail(s string) string {
	const n = 4000
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

package sysvm

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/elidisk/eli/integration/vm"
	"github.com/elidisk/eli/nbd"
)

//go:embed init.sh
var initScript []byte

// initramfsModules are what the initramfs loads: what mounts the root disk, and the
// agent's port, for the agent to start before udev.
var initramfsModules = []string{"virtio_pci", "virtio_blk", "crc32c_generic", "ext4", "virtio_console"}

// Config describes a machine.
type Config struct {
	Assets Assets
	Dir    string // its sockets, initramfs and console logs; must exist
	QEMU   string // qemu-system-x86_64
	// Busybox is a statically linked busybox (Debian's busybox-static), the initramfs's
	// shell.
	Busybox string
	Root    *Disk                // /dev/vda
	Disks   []NamedDisk          // /dev/vdb, /dev/vdc, ... in order
	Memory  int                  // MiB; 0 means 1024
	CPUs    int                  // 0 means 2
	Network bool                 // a virtio NIC on qemu's user network, with no way out of the host
	Cmdline string               // added to the kernel's command line
	Logf    func(string, ...any) // progress lines; nil discards
}

// NamedDisk is a data disk; the guest also finds it as /dev/disk/by-id/virtio-NAME.
type NamedDisk struct {
	Name string // [a-z0-9]+, at most 20 bytes (virtio-blk's serial)
	Disk *Disk
}

// Machine is a qemu guest booting Debian with systemd from Disks, booted any number of
// times in turn: each boot is a qemu process over the same disks, ended by a clean
// reboot or power-off in the guest, or by a power cut.
type Machine struct {
	cfg    Config
	initrd string

	mu      sync.Mutex
	boots   int
	qemu    *exec.Cmd
	exited  chan struct{} // closed when qemu of the current boot has exited
	exitErr error
	server  *nbd.Server
	agent   *agentConn
}

// Result is what a script run in the guest did.
type Result struct {
	RC             int
	Stdout, Stderr []byte
}

func (r Result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.RC, r.Stdout, r.Stderr)
}

// New prepares a machine (its initramfs); Boot starts it.
func New(cfg Config) (*Machine, error) {
	if cfg.Memory == 0 {
		cfg.Memory = 1024
	}
	if cfg.CPUs == 0 {
		cfg.CPUs = 2
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	if cfg.Root == nil {
		return nil, errors.New("sysvm: no root disk")
	}
	for _, d := range cfg.Disks {
		if d.Name == "" || len(d.Name) > 20 || strings.Trim(d.Name, "abcdefghijklmnopqrstuvwxyz0123456789") != "" || d.Name == "root" {
			return nil, fmt.Errorf("sysvm: disk name %q: want 1 to 20 of [a-z0-9], not \"root\"", d.Name)
		}
	}
	m := &Machine{cfg: cfg, initrd: filepath.Join(cfg.Dir, "initrd.gz")}
	if err := m.buildInitramfs(); err != nil {
		return nil, err
	}
	return m, nil
}

// buildInitramfs writes an initramfs that loads the root disk's drivers, mounts it and
// hands over to its systemd (init.sh).
func (m *Machine) buildInitramfs() error {
	var rd vm.Initramfs
	rd.File("init", initScript, 0o755)
	if err := rd.CopyFile("bin/busybox", m.cfg.Busybox); err != nil {
		return fmt.Errorf("sysvm: initramfs: %w", err)
	}
	for _, applet := range []string{"sh", "mount", "umount", "insmod", "mkdir", "sleep", "cat", "switch_root", "poweroff"} {
		rd.Symlink("bin/"+applet, "busybox")
	}
	for _, d := range []string{"proc", "sys", "dev", "newroot"} {
		rd.Dir(d)
	}
	mods, err := vm.Resolve(filepath.Join(m.cfg.Assets.Modules, "kernel"), initramfsModules)
	if err != nil {
		return fmt.Errorf("sysvm: initramfs: %w", err)
	}
	var order []string
	for _, p := range mods {
		if err := rd.CopyFile("lib/sysvm/"+filepath.Base(p), p); err != nil {
			return err
		}
		order = append(order, filepath.Base(p))
	}
	rd.File("lib/sysvm/order", []byte(strings.Join(order, "\n")+"\n"), 0o644)
	f, err := os.Create(m.initrd)
	if err != nil {
		return err
	}
	if _, err := rd.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Boots is the number of boots started so far.
func (m *Machine) Boots() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.boots
}

// ConsolePath is the serial console's log of boot n (1 is the first).
func (m *Machine) ConsolePath(n int) string {
	return filepath.Join(m.cfg.Dir, fmt.Sprintf("console-%d.log", n))
}

// Console is the serial console of the current (or last) boot.
func (m *Machine) Console() string {
	b, _ := os.ReadFile(m.ConsolePath(m.Boots()))
	return string(b)
}

// BootInfo is what Boot saw.
type BootInfo struct {
	BootID string // the guest kernel's boot_id
	// State is `systemctl is-system-running --wait`'s answer once the boot is over:
	// "running" when every unit started, "degraded" when some failed.
	State string
	Took  time.Duration // from starting qemu to State
}

// Boot starts qemu and waits until the agent answers and systemd has finished
// booting (or ctx ends, or qemu exits first: then the error holds the console's end).
func (m *Machine) Boot(ctx context.Context) (BootInfo, error) {
	m.mu.Lock()
	if m.qemu != nil {
		m.mu.Unlock()
		return BootInfo{}, errors.New("sysvm: Boot while a boot is running")
	}
	m.boots++
	n := m.boots
	m.mu.Unlock()
	start := time.Now()

	// A server and socket per boot: a Disk's Backend ends at a power cut.
	nbdSock := filepath.Join(m.cfg.Dir, fmt.Sprintf("nbd-%d.sock", n))
	exports := []nbd.Export{{Name: "root", Backend: m.cfg.Root.Backend()}}
	for _, d := range m.cfg.Disks {
		exports = append(exports, nbd.Export{Name: d.Name, Backend: d.Disk.Backend()})
	}
	srv := &nbd.Server{Exports: exports}
	nl, err := nbd.ListenUnix(nbdSock)
	if err != nil {
		return BootInfo{}, err
	}
	go srv.Serve(nl)

	agentSock := filepath.Join(m.cfg.Dir, fmt.Sprintf("agent-%d.sock", n))
	al, err := net.Listen("unix", agentSock)
	if err != nil {
		srv.Shutdown(context.Background())
		return BootInfo{}, err
	}

	cmdline := "console=ttyS0 root=/dev/vda panic=-1 loglevel=4 " + m.cfg.Cmdline
	args := []string{
		"-accel", "tcg", "-machine", "pc", "-m", strconv.Itoa(m.cfg.Memory), "-smp", strconv.Itoa(m.cfg.CPUs),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", m.cfg.Assets.Kernel, "-initrd", m.initrd, "-append", cmdline,
		"-serial", "file:" + m.ConsolePath(n),
		"-device", "virtio-rng-pci",
		"-device", "virtio-serial-pci",
		"-chardev", "socket,id=agent,path=" + agentSock,
		"-device", "virtserialport,chardev=agent,name=" + agentPort,
	}
	drive := func(name string) {
		// cache=none: no host cache between the guest and the Disk, and the guest is
		// told its disk has a volatile cache, so it sends flushes.
		args = append(args,
			"-drive", fmt.Sprintf("file=nbd+unix:///%s?socket=%s,format=raw,if=none,id=%s,cache=none,discard=unmap", name, nbdSock, name),
			"-device", fmt.Sprintf("virtio-blk-pci,drive=%s,serial=%s", name, name))
	}
	drive("root")
	for _, d := range m.cfg.Disks {
		drive(d.Name)
	}
	if m.cfg.Network {
		args = append(args, "-nic", "user,model=virtio-net-pci,restrict=on")
	}
	cmd := exec.Command(m.cfg.QEMU, args...)
	// qemu dies with the test, also when a test times out and its cleanups never run.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var qout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &qout, &qout
	m.cfg.Logf("boot %d: starting qemu", n)
	if err := cmd.Start(); err != nil {
		al.Close()
		srv.Shutdown(context.Background())
		return BootInfo{}, fmt.Errorf("sysvm: start qemu: %w", err)
	}
	exited := make(chan struct{})
	m.mu.Lock()
	m.qemu, m.exited, m.server = cmd, exited, srv
	m.mu.Unlock()
	go func() {
		err := cmd.Wait()
		if err != nil {
			err = fmt.Errorf("%w: %s", err, strings.TrimSpace(qout.String()))
		}
		m.mu.Lock()
		m.exitErr = err
		m.mu.Unlock()
		close(exited)
	}()

	// qemu connects to the agent's socket while it starts.
	conn, err := acceptUntil(ctx, al, exited)
	al.Close()
	if err != nil {
		return BootInfo{}, m.bootFailed(n, fmt.Errorf("qemu did not connect the agent's port: %w", err))
	}
	ac := newAgentConn(conn, exited)
	m.mu.Lock()
	m.agent = ac
	m.mu.Unlock()
	var info BootInfo
	select {
	case info.BootID = <-ac.hello:
	case <-exited:
		return info, m.bootFailed(n, errors.New("qemu exited before the agent started"))
	case <-ctx.Done():
		return info, m.bootFailed(n, fmt.Errorf("no agent after %v: %w", time.Since(start).Round(time.Second), ctx.Err()))
	}
	m.cfg.Logf("boot %d: agent up after %v", n, time.Since(start).Round(time.Millisecond))
	r, err := m.Run(ctx, "systemctl is-system-running --wait")
	if err != nil {
		return info, m.bootFailed(n, err)
	}
	info.State = strings.TrimSpace(string(r.Stdout))
	info.Took = time.Since(start)
	m.cfg.Logf("boot %d: %s after %v", n, info.State, info.Took.Round(time.Millisecond))
	return info, nil
}

func (m *Machine) bootFailed(n int, err error) error {
	m.mu.Lock()
	qerr := m.exitErr
	m.mu.Unlock()
	if qerr != nil {
		err = fmt.Errorf("%w (qemu: %v)", err, qerr)
	}
	return fmt.Errorf("sysvm: boot %d: %w\nconsole (end):\n%s", n, err, tail(m.Console(), 4000))
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

func acceptUntil(ctx context.Context, l net.Listener, exited <-chan struct{}) (net.Conn, error) {
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() {
		c, err := l.Accept()
		ch <- res{c, err}
	}()
	select {
	case r := <-ch:
		return r.c, r.err
	case <-exited:
		return nil, errors.New("qemu exited")
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Run runs script with bash in the guest (as root, in /root) and returns its exit
// status and output. An error means the script could not be run or its result did not
// come back (ctx ended, the machine went down); a script that fails is a Result with
// RC != 0.
func (m *Machine) Run(ctx context.Context, script string) (Result, error) {
	return m.RunInput(ctx, script, nil)
}

// RunInput is Run with stdin as the script's standard input.
func (m *Machine) RunInput(ctx context.Context, script string, stdin []byte) (Result, error) {
	m.mu.Lock()
	ac := m.agent
	m.mu.Unlock()
	if ac == nil {
		return Result{}, errors.New("sysvm: the machine is not running")
	}
	return ac.run(ctx, script, stdin)
}

// WriteFile puts data at path in the guest (through the agent).
func (m *Machine) WriteFile(ctx context.Context, path string, data []byte, mode os.FileMode) error {
	r, err := m.RunInput(ctx, fmt.Sprintf("install -D -m %o /dev/stdin %s", mode.Perm(), shellQuote(path)), data)
	if err != nil {
		return err
	}
	if r.RC != 0 {
		return fmt.Errorf("sysvm: write %s in the guest: %s", path, r)
	}
	return nil
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// Wait waits until qemu of the current boot exits, as it does when the guest reboots or
// powers off (it runs with -no-reboot), and returns its error.
func (m *Machine) Wait(ctx context.Context) error {
	m.mu.Lock()
	exited := m.exited
	m.mu.Unlock()
	if exited == nil {
		return errors.New("sysvm: the machine is not running")
	}
	select {
	case <-exited:
	case <-ctx.Done():
		return fmt.Errorf("sysvm: qemu still running: %w", ctx.Err())
	}
	return m.ended()
}

// ended cleans up after qemu's exit and returns its error.
func (m *Machine) ended() error {
	m.mu.Lock()
	srv, err := m.server, m.exitErr
	m.qemu, m.exited, m.server, m.agent = nil, nil, nil, nil
	m.mu.Unlock()
	if srv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		srv.Shutdown(sctx)
		cancel()
	}
	return err
}

// shutdown asks systemd to reboot or power off and waits for qemu to exit.
func (m *Machine) shutdown(ctx context.Context, verb string) error {
	// The reply may not come back, or come back as killed: the agent and the systemctl
	// it runs are stopped by the very shutdown they start. qemu's exit is the answer.
	r, runErr := m.Run(ctx, "systemctl --no-block "+verb)
	if err := m.Wait(ctx); err != nil {
		return fmt.Errorf("sysvm: %s: %w (systemctl: %v, %s)\nconsole (end):\n%s", verb, err, runErr, r, tail(m.Console(), 4000))
	}
	return nil
}

// Reboot reboots the guest cleanly (systemctl reboot) and boots it again. Nothing is
// lost from the disks' caches: the power stays on.
func (m *Machine) Reboot(ctx context.Context) (BootInfo, error) {
	if err := m.shutdown(ctx, "reboot"); err != nil {
		return BootInfo{}, err
	}
	return m.Boot(ctx)
}

// Poweroff shuts the guest down cleanly (systemctl poweroff); the disks keep what is in
// their caches until a PowerCut.
func (m *Machine) Poweroff(ctx context.Context) error { return m.shutdown(ctx, "poweroff") }

// PowerCut stops the guest at once (SIGKILL to qemu, if it runs) and then cuts every
// disk's power: what was not flushed is lost as mode says (rng: see Disk.Cut). It
// returns what each disk lost, by name ("root" for the root disk).
func (m *Machine) PowerCut(mode CutMode, rng *rand.Rand) (map[string]CutStats, error) {
	m.Kill()
	return m.cutAll(mode, rng, nil)
}

// PowerCutWhen waits, while the guest runs, for the first moment when ready says yes to
// the number of unflushed 4 KiB blocks on each disk (by name), and cuts the power then:
// every disk is cut at that moment, before any other request reaches it, and qemu is
// killed. So a test can cut the power mid-write and know that the cut found unflushed
// writes. It gives up when ctx ends or the guest stops.
func (m *Machine) PowerCutWhen(ctx context.Context, ready func(unflushed map[string]int) bool, mode CutMode, rng *rand.Rand) (map[string]CutStats, error) {
	m.mu.Lock()
	exited := m.exited
	m.mu.Unlock()
	if exited == nil {
		return nil, errors.New("sysvm: the machine is not running")
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("sysvm: the disks never were as the power cut waits for: %w", ctx.Err())
		case <-exited:
			return nil, errors.New("sysvm: the machine stopped before the power cut")
		case <-tick.C:
		}
		res, err := m.cutAll(mode, rng, ready)
		if err != nil || res != nil {
			m.Kill()
			return res, err
		}
	}
}

// cutAll cuts every disk, holding all of them meanwhile; with ready, only if it says yes
// (else it returns nil, nil).
func (m *Machine) cutAll(mode CutMode, rng *rand.Rand, ready func(map[string]int) bool) (map[string]CutStats, error) {
	disks := append([]NamedDisk{{"root", m.cfg.Root}}, m.cfg.Disks...)
	for _, d := range disks {
		d.Disk.mu.Lock()
		defer d.Disk.mu.Unlock()
	}
	if ready != nil {
		unflushed := map[string]int{}
		for _, d := range disks {
			unflushed[d.Name] = d.Disk.unflushedLocked()
		}
		if !ready(unflushed) {
			return nil, nil
		}
	}
	res := map[string]CutStats{}
	for _, d := range disks {
		st, err := d.Disk.cutLocked(mode, rng)
		if err != nil {
			return res, fmt.Errorf("sysvm: power cut of disk %s: %w", d.Name, err)
		}
		res[d.Name] = st
	}
	return res, nil
}

// Kill stops qemu at once, if it runs.
func (m *Machine) Kill() {
	m.mu.Lock()
	cmd, exited := m.qemu, m.exited
	m.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Kill()
	<-exited
	m.ended()
}

// Close kills qemu if it runs; the disks are the caller's.
func (m *Machine) Close() { m.Kill() }

// UnitTimes returns when each unit became active, measured from the kernel's start
// (systemd's ActiveEnterTimestampMonotonic); a unit that never became active in this
// boot is an error.
func (m *Machine) UnitTimes(ctx context.Context, units ...string) (map[string]time.Duration, error) {
	var sh strings.Builder
	for _, u := range units {
		fmt.Fprintf(&sh, "systemctl show -P ActiveEnterTimestampMonotonic %s\n", shellQuote(u))
	}
	r, err := m.Run(ctx, sh.String())
	if err != nil {
		return nil, err
	}
	lines := strings.Fields(string(r.Stdout))
	if r.RC != 0 || len(lines) != len(units) {
		return nil, fmt.Errorf("sysvm: unit times: %s", r)
	}
	res := map[string]time.Duration{}
	for i, u := range units {
		us, err := strconv.ParseInt(lines[i], 10, 64)
		if err != nil || us <= 0 {
			return nil, fmt.Errorf("sysvm: unit %s was not active in this boot (ActiveEnterTimestampMonotonic %q)", u, lines[i])
		}
		res[u] = time.Duration(us) * time.Microsecond
	}
	return res, nil
}

// agentConn is the host's end of the agent's port.
type agentConn struct {
	c     net.Conn
	hello chan string
	wmu   sync.Mutex

	mu      sync.Mutex
	next    uint64
	waiting map[uint64]chan agentReply
	err     error // why the connection ended
	down    <-chan struct{}
}

type agentRequest struct {
	ID      uint64 `json:"id"`
	Sh      string `json:"sh"`
	Stdin   []byte `json:"stdin,omitempty"`
	Timeout int64  `json:"timeout_ms,omitempty"`
}

type agentReply struct {
	ID     uint64 `json:"id"`
	Hello  string `json:"hello"`
	RC     int    `json:"rc"`
	Stdout []byte `json:"stdout"`
	Stderr []byte `json:"stderr"`
	Err    string `json:"err"`
}

// maxReply bounds one reply line from the guest.
const maxReply = 256 << 20

func newAgentConn(c net.Conn, down <-chan struct{}) *agentConn {
	a := &agentConn{c: c, hello: make(chan string, 1), waiting: map[uint64]chan agentReply{}, down: down}
	go a.read()
	return a
}

func (a *agentConn) read() {
	br := bufio.NewReaderSize(a.c, 1<<20)
	var err error
	for {
		var line []byte
		for {
			part, rerr := br.ReadSlice('\n')
			line = append(line, part...)
			if len(line) > maxReply {
				rerr = fmt.Errorf("reply longer than %d bytes", maxReply)
			}
			if rerr == nil {
				break
			}
			if !errors.Is(rerr, bufio.ErrBufferFull) {
				err = rerr
				break
			}
		}
		if err != nil {
			break
		}
		var r agentReply
		if jerr := json.Unmarshal(line, &r); jerr != nil {
			// The guest's console noise never comes here; a bad line is a bug.
			err = fmt.Errorf("bad line from the agent: %v: %q", jerr, tail(string(line), 200))
			break
		}
		if r.Hello != "" {
			select {
			case a.hello <- r.Hello:
			default:
			}
			continue
		}
		a.mu.Lock()
		ch := a.waiting[r.ID]
		delete(a.waiting, r.ID)
		a.mu.Unlock()
		if ch != nil {
			ch <- r
		}
	}
	a.mu.Lock()
	a.err = fmt.Errorf("the agent's connection ended: %w", err)
	for id, ch := range a.waiting {
		close(ch)
		delete(a.waiting, id)
	}
	a.mu.Unlock()
	a.c.Close()
}

func (a *agentConn) run(ctx context.Context, script string, stdin []byte) (Result, error) {
	ch := make(chan agentReply, 1)
	a.mu.Lock()
	if a.err != nil {
		a.mu.Unlock()
		return Result{}, a.err
	}
	a.next++
	req := agentRequest{ID: a.next, Sh: script, Stdin: stdin}
	if dl, ok := ctx.Deadline(); ok {
		req.Timeout = max(1, time.Until(dl).Milliseconds())
	}
	a.waiting[req.ID] = ch
	a.mu.Unlock()
	line, err := json.Marshal(req)
	if err != nil {
		return Result{}, err
	}
	a.wmu.Lock()
	a.c.SetWriteDeadline(time.Now().Add(time.Minute))
	_, err = a.c.Write(append(line, '\n'))
	a.wmu.Unlock()
	if err != nil {
		return Result{}, fmt.Errorf("sysvm: send to the agent: %w", err)
	}
	select {
	case r, ok := <-ch:
		if !ok {
			a.mu.Lock()
			err := a.err
			a.mu.Unlock()
			return Result{}, fmt.Errorf("sysvm: no result for %q: %w", tail(script, 80), err)
		}
		res := Result{RC: r.RC, Stdout: r.Stdout, Stderr: r.Stderr}
		if r.Err != "" {
			return res, fmt.Errorf("sysvm: agent: %s (script %q)", r.Err, tail(script, 80))
		}
		return res, nil
	case <-ctx.Done():
		a.mu.Lock()
		delete(a.waiting, req.ID)
		a.mu.Unlock()
		return Result{}, fmt.Errorf("sysvm: script %q: %w", tail(script, 80), ctx.Err())
	}
}

package nbdkernel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/elidisk/eli/provider"
	"golang.org/x/sys/unix"
)

// host holds the roots the device checks read, so that tests can point them at a fake
// tree.
type host struct {
	sys, proc, dev string
	self           int // our own pid, whose open files do not count as users
}

var realHost = host{sys: "/sys", proc: "/proc", dev: "/dev", self: os.Getpid()}

func (h host) block(idx int, file string) string {
	return filepath.Join(h.sys, "block", fmt.Sprintf("nbd%d", idx), file)
}

func (h host) readAttr(idx int, file string) (string, error) {
	b, err := os.ReadFile(h.block(idx, file))
	return strings.TrimSpace(string(b)), err
}

// connectedPid is the pid of the process that connected /dev/nbd<idx>, which the kernel
// shows only while the device is connected; 0 if it is not.
func (h host) connectedPid(idx int) int {
	s, err := h.readAttr(idx, "pid")
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(s)
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// Attach connects c to /dev/nbd<c.Index>. If that device is still connected for the same
// backend but the process that connected it is gone (a server killed, or stopped for an
// upgrade without disconnecting), it plugs c's sockets into the live device instead
// (Reconfigure): a filesystem mounted on it sees the I/O it issued meanwhile complete
// late, not fail, provided this happens within the dead-connection timeout.
// A volume grown meanwhile ('eli resize' between 'detach --keep-device' and attach)
// grows the live device; a smaller one is refused.
// It returns the device index and whether the device was re-plugged.
func Attach(c Config) (idx int, replugged bool, err error) {
	return realHost.attach(c, Connect, Reconfigure)
}

func (h host) attach(c Config, connect func(Config) (int, error), reconfigure func(Config) error) (int, bool, error) {
	if c.Index >= 0 {
		if pid := h.connectedPid(c.Index); pid > 0 {
			backend, _ := h.readAttr(c.Index, "backend")
			switch {
			case c.Backend == "" || backend != c.Backend:
				return -1, false, fmt.Errorf("/dev/nbd%d is connected to another export (backend %q): attach that volume to it, "+
					"or choose another device (its connection is released by 'nbd-client -d /dev/nbd%d')", c.Index, backend, c.Index)
			case processAlive(pid):
				return -1, false, fmt.Errorf("/dev/nbd%d is still served by pid %d", c.Index, pid)
			}
			// Growing is what 'detach --keep-device', 'resize', 'attach' is for; a
			// smaller volume would cut the filesystem on the device short.
			if sectors, err := h.readAttr(c.Index, "size"); err == nil {
				if n, err := strconv.ParseUint(sectors, 10, 64); err == nil && c.Size < n*512 {
					return -1, false, fmt.Errorf("/dev/nbd%d has %d bytes, more than the volume's %d", c.Index, n*512, c.Size)
				}
			}
			if err := reconfigure(c); err != nil {
				return -1, false, fmt.Errorf("re-plug /dev/nbd%d: %w", c.Index, err)
			}
			return c.Index, true, nil
		}
	}
	idx, err := connect(c)
	return idx, false, err
}

// DeadConnTimeout (seconds) is how long the kernel holds a device's I/O after its server
// died, for a new 'eli attach' of the same provider to re-plug it: long enough for a
// supervisor to restart the server (a restart takes well under a second plus the KDF),
// short enough that a server that is gone for good fails the I/O in a minute.
const DeadConnTimeout = 60

// BackendID names an export for the kernel's backend check: the volume's ID, so that a
// device is only ever re-plugged to the volume it was connected to.
func BackendID(volumeID []byte) string { return fmt.Sprintf("eli:%x", volumeID) }

// MaxSectorsKiB is the request size eli asks the kernel to send at most. The kernel's
// default for nbd is 128 KiB, while eli's server takes requests of up to 32 MiB and
// spends per request (a round trip, a metadata commit per run of sectors) what it does
// not spend per byte: larger requests mean fewer of them for streaming I/O.
const MaxSectorsKiB = 1024

// Tune raises the device's max_sectors_kb to MaxSectorsKiB (bounded by the driver's
// max_hw_sectors_kb), and returns the value the kernel now uses.
func Tune(idx int) (int, error) { return realHost.tune(idx, MaxSectorsKiB) }

func (h host) tune(idx, wantKiB int) (int, error) {
	hw, err := h.readAttr(idx, "queue/max_hw_sectors_kb")
	if err != nil {
		return 0, err
	}
	limit, err := strconv.Atoi(hw)
	if err != nil {
		return 0, fmt.Errorf("max_hw_sectors_kb %q: %w", hw, err)
	}
	v := min(wantKiB, limit)
	if err := os.WriteFile(h.block(idx, "queue/max_sectors_kb"), []byte(strconv.Itoa(v)), 0); err != nil {
		return 0, err
	}
	return v, nil
}

// InUse says why /dev/nbd<idx> must not be disconnected now: a filesystem mounted on
// it, a device stacked on it (dm, md), a program holding it exclusively, or any process
// with it open. It returns "" when nothing uses it. Checking and disconnecting are not
// atomic: this guards against mistakes, not against a race with a concurrent mount.
func InUse(idx int) (string, error) { return realHost.inUse(idx) }

func (h host) inUse(idx int) (string, error) {
	devStr, err := h.readAttr(idx, "dev")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", nil // no such device: nothing can use it
		}
		return "", err
	}
	maj, mnr, ok := parseMajMin(devStr)
	if !ok {
		return "", fmt.Errorf("/dev/nbd%d: unexpected dev %q", idx, devStr)
	}
	rdev := unix.Mkdev(maj, mnr)
	var why []string
	if f, err := os.Open(filepath.Join(h.proc, "self", "mountinfo")); err == nil {
		for _, m := range provider.MountPoints(f, devStr) {
			why = append(why, "mounted on "+m)
		}
		f.Close()
	}
	if ents, err := os.ReadDir(h.block(idx, "holders")); err == nil {
		for _, e := range ents {
			why = append(why, "held by "+e.Name())
		}
	}
	if len(why) == 0 {
		// Mounts in another mount namespace, swap, or a program's O_EXCL open all claim
		// the device, and an exclusive open of our own then fails with EBUSY.
		node := filepath.Join(h.dev, fmt.Sprintf("nbd%d", idx))
		fd, err := unix.Open(node, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err == nil {
			unix.Close(fd)
		} else if errors.Is(err, unix.EBUSY) {
			why = append(why, "claimed exclusively (mounted in another namespace, swap, or a program)")
		}
	}
	for _, p := range openers(h.proc, h.self, func(st *unix.Stat_t) bool {
		return st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == rdev
	}) {
		why = append(why, fmt.Sprintf("open by pid %d (%s)", p.pid, p.comm))
	}
	return strings.Join(why, ", "), nil
}

func parseMajMin(s string) (uint32, uint32, bool) {
	a, b, ok := strings.Cut(s, ":")
	if !ok {
		return 0, 0, false
	}
	maj, err1 := strconv.ParseUint(a, 10, 32)
	mnr, err2 := strconv.ParseUint(b, 10, 32)
	return uint32(maj), uint32(mnr), err1 == nil && err2 == nil
}

type opener struct {
	pid  int
	comm string
}

// openers lists the processes (other than self) with an open file that match accepts,
// by following each /proc/PID/fd link. Processes it may not inspect are skipped.
func openers(proc string, self int, match func(*unix.Stat_t) bool) []opener {
	ents, err := os.ReadDir(proc)
	if err != nil {
		return nil
	}
	var out []opener
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		fdDir := filepath.Join(proc, e.Name(), "fd")
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			var st unix.Stat_t
			if unix.Stat(filepath.Join(fdDir, fd.Name()), &st) != nil || !match(&st) {
				continue
			}
			comm, _ := os.ReadFile(filepath.Join(proc, e.Name(), "comm"))
			out = append(out, opener{pid: pid, comm: strings.TrimSpace(string(comm))})
			break
		}
	}
	return out
}

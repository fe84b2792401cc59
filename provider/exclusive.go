package provider

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrBusy: a block device is mounted, or claimed by the kernel or a program (a
// device-mapper or md array on it, swap, another exclusive open).
var ErrBusy = errors.New("device is in use")

// BusyError is ErrBusy with what holds the device, where it could be found.
type BusyError struct {
	Path string
	Why  string // "mounted on /mnt", "held by dm-0", ...; empty if not found
}

func (e *BusyError) Error() string {
	if e.Why == "" {
		return fmt.Sprintf("%s: %v (claimed exclusively: mounted in another namespace, swap, or a program)", e.Path, ErrBusy)
	}
	return fmt.Sprintf("%s: %v: %s", e.Path, ErrBusy, e.Why)
}

func (e *BusyError) Unwrap() error { return ErrBusy }

// OpenExclusive opens path for reading and writing, a block device exclusively
// (O_EXCL, open(2)): the kernel then refuses it to mounts, to device-mapper, md and swap,
// and to other exclusive opens for as long as it stays open, and refuses it to us with
// *BusyError while one of those holds it. A regular file is opened as Open does.
func OpenExclusive(path string) (*File, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return Open(path, false)
	}
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_EXCL|syscall.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) {
		return nil, &BusyError{Path: path, Why: DeviceUsers(st.Rdev)}
	}
	if err != nil {
		return nil, fmt.Errorf("open provider: %w", err)
	}
	p, err := FromFile(f, path)
	if err != nil {
		f.Close()
		return nil, err
	}
	return p, nil
}

// DeviceUsers says what uses the block device rdev, from what the kernel shows of
// mounts (/proc/self/mountinfo, proc(5): field 3 is major:minor, field 5 the mount
// point), holders (/sys/dev/block/MAJ:MIN/holders) and swap (/proc/swaps): "mounted on
// /mnt, held by dm-0", or "" if none of them names it.
func DeviceUsers(rdev uint64) string {
	majMin := fmt.Sprintf("%d:%d", unix.Major(rdev), unix.Minor(rdev))
	var why []string
	if f, err := os.Open("/proc/self/mountinfo"); err == nil {
		for _, m := range MountPoints(f, majMin) {
			why = append(why, "mounted on "+m)
		}
		f.Close()
	}
	if ents, err := os.ReadDir(filepath.Join("/sys/dev/block", majMin, "holders")); err == nil {
		for _, e := range ents {
			why = append(why, "held by "+e.Name())
		}
	}
	if f, err := os.Open("/proc/swaps"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			var st unix.Stat_t
			if len(fields) > 0 && unix.Stat(fields[0], &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == rdev {
				why = append(why, "used as swap")
			}
		}
		f.Close()
	}
	return strings.Join(why, ", ")
}

// MountPoints returns the mount points of the device majMin ("43:0") in a mountinfo
// file (proc(5): field 3 is major:minor, field 5 the mount point, octal-escaped).
func MountPoints(r io.Reader, majMin string) []string {
	var out []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 5 && f[2] == majMin {
			out = append(out, unescapeMount(f[4]))
		}
	}
	return out
}

// unescapeMount undoes the kernel's \ooo escaping of space, tab, newline and backslash.
func unescapeMount(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

package nbdkernel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNoFreeDevice: every /dev/nbdN is connected or being connected.
var ErrNoFreeDevice = errors.New("no free /dev/nbdN")

// Pick chooses the device for a volume whose backend identifier is backend (BackendID),
// for 'attach --device auto': the device that waits for this volume, connected to its
// backend with its server gone (a restart, or a crash, that Attach re-plugs), or else
// the free device of the lowest number. Concurrent attaches at boot must not choose the
// same free device, so the choice is claimed with a lock file in claimDir, which the
// caller holds until the device is connected (then the kernel shows it as taken) or
// the attach failed: release lets go of it.
func Pick(backend, claimDir string) (path string, release func(), err error) {
	idx, release, err := realHost.pick(backend, claimDir)
	if err != nil {
		return "", nil, err
	}
	return fmt.Sprintf("/dev/nbd%d", idx), release, nil
}

func (h host) pick(backend, claimDir string) (int, func(), error) {
	entries, err := os.ReadDir(filepath.Join(h.sys, "block"))
	if err != nil {
		return -1, nil, err
	}
	var idxs []int
	for _, e := range entries {
		if n, ok := strings.CutPrefix(e.Name(), "nbd"); ok {
			if i, err := strconv.Atoi(n); err == nil && i >= 0 {
				idxs = append(idxs, i)
			}
		}
	}
	if len(idxs) == 0 {
		return -1, nil, fmt.Errorf("%w: the nbd module is not loaded (modprobe nbd)", ErrNoFreeDevice)
	}
	sort.Ints(idxs)
	if err := os.MkdirAll(claimDir, 0o700); err != nil {
		return -1, nil, err
	}
	// A device waiting for this very volume comes first: connecting the volume anywhere
	// else would leave a mounted file system on the old device to fail.
	for _, i := range idxs {
		if pid := h.connectedPid(i); pid > 0 && !processAlive(pid) {
			if b, _ := h.readAttr(i, "backend"); backend != "" && b == backend {
				if release, ok := claim(claimDir, i); ok {
					return i, release, nil
				}
			}
		}
	}
	for _, i := range idxs {
		if h.connectedPid(i) > 0 {
			continue
		}
		if release, ok := claim(claimDir, i); ok {
			// Taken between the look and the claim by something that does not claim
			// (nbd-client, qemu-nbd): look again under the claim.
			if h.connectedPid(i) == 0 {
				return i, release, nil
			}
			release()
		}
	}
	return -1, nil, fmt.Errorf("%w: all %d are connected or being connected (modprobe nbd nbds_max=N makes more)", ErrNoFreeDevice, len(idxs))
}

// claim takes the lock file of device i in dir without waiting; ok is false when another
// process holds it. The lock is the open descriptor's: it goes with the process.
func claim(dir string, i int) (release func(), ok bool) {
	f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("nbd%d.claim", i)), os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, false
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, false
	}
	return func() { f.Close() }, true
}

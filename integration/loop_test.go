package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// This machine (and CI) has no nbd kernel module, so an export becomes a Linux block
// device the way README.md shows: nbdfuse exposes it as a file in a FUSE mount, losetup
// turns the file into /dev/loopN. Every step registers its undoing with t.Cleanup, so a
// failing test leaves no mount, loop device or FUSE mount behind (and sweepStale catches
// what a killed run left).

// needBlockTools stops the test unless everything a mounted block device needs is here.
func needBlockTools(t testing.TB) {
	t.Helper()
	testtool.NeedRoot(t)
	testtool.Need(t, "nbdfuse", "libnbd-bin")
	testtool.Need(t, "fusermount3", "fuse3")
	testtool.Need(t, "losetup", "mount")
	testtool.Need(t, "mkfs.ext4", "e2fsprogs")
	testtool.Need(t, "e2fsck", "e2fsprogs")
	if _, err := os.Stat("/dev/fuse"); err != nil {
		testtool.Missing(t, "/dev/fuse (FUSE)")
	}
}

// blockDevice exposes the export at uri as a loop device with the given logical sector
// size and returns its path. Undo it with the returned function (idempotent), or let
// t.Cleanup do it.
func (e *env) blockDevice(uri string, sectorSize int) (string, func()) {
	t := e.t
	t.Helper()
	dir := e.mkdirTemp("", "fuse")
	file := filepath.Join(dir, "nbd")
	fuse := exec.Command("nbdfuse", file, uri)
	var fuseOut strings.Builder
	fuse.Stdout, fuse.Stderr = &fuseOut, &fuseOut
	if err := fuse.Start(); err != nil {
		t.Fatalf("nbdfuse: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- fuse.Wait() }()
	var loop string
	done := false
	undo := func() {
		if done {
			return
		}
		done = true
		if loop != "" {
			if out, err := commandErr(time.Minute, "losetup", "-d", loop); err != nil {
				t.Errorf("losetup -d %s: %v\n%s", loop, err, out)
			}
		}
		if out, err := commandErr(time.Minute, "fusermount3", "-u", dir); err != nil {
			t.Logf("fusermount3 -u %s: %v\n%s; unmounting lazily", dir, err, out)
			commandErr(time.Minute, "fusermount3", "-u", "-z", dir)
		}
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			fuse.Process.Kill()
			<-exited
			t.Errorf("nbdfuse did not exit after its unmount:\n%s", fuseOut.String())
		}
	}
	t.Cleanup(undo)

	// nbdfuse serves the file once the NBD handshake is done.
	deadline := time.Now().Add(20 * time.Second)
	for {
		if st, err := os.Stat(file); err == nil && st.Size() > 0 {
			break
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("nbdfuse exited: %v\n%s", err, fuseOut.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("nbdfuse did not expose %s within 20 s:\n%s", file, fuseOut.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// --direct-io=off: the FUSE file does not take O_DIRECT. The loop device's logical
	// sector size is the volume's, as a real disk's would be.
	out := command(t, time.Minute, "losetup", "--find", "--show", "--direct-io=off",
		"--sector-size", fmt.Sprint(sectorSize), file)
	loop = strings.TrimSpace(out)
	if !strings.HasPrefix(loop, "/dev/loop") {
		t.Fatalf("losetup printed %q, not a loop device", out)
	}
	return loop, undo
}

// mount mounts dev on a new directory and returns it, with an undo function
// (idempotent; a lazy unmount if a plain one fails).
func (e *env) mount(dev string, opts ...string) (string, func()) {
	t := e.t
	t.Helper()
	dir := e.mkdirTemp("", "mnt")
	command(t, time.Minute, "mount", append(opts, dev, dir)...)
	done := false
	undo := func() {
		if done {
			return
		}
		done = true
		if out, err := commandErr(time.Minute, "umount", dir); err != nil {
			t.Errorf("umount %s: %v\n%s", dir, err, out)
			commandErr(time.Minute, "umount", "-l", dir)
		}
	}
	t.Cleanup(undo)
	return dir, undo
}

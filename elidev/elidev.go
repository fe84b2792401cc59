// Package elidev names a volume's kernel NBD device /dev/eli/NAME, the stable name that
// /etc/fstab uses as it uses /dev/mapper/NAME for a crypttab volume.
//
// udev makes the name, so that systemd, which learns of devices and their names from
// udev, has a dev-eli-NAME.device unit for a mount to wait for. The kernel only knows
// the device by its number and its backend identifier (eli:VOLUME-ID); eli's udev rule
// (60-eli.rules) reads the name from a file named by that identifier, which Name writes
// before it asks udev to look at the device again. Where udev does not run (a container,
// a minimal initramfs), Name makes the link itself.
package elidev

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Host holds the places Name touches, so that tests can point them at a tree of their
// own.
type Host struct {
	Sys string // /sys
	Dev string // /dev
	// Names is where the rule finds a backend's name: /run/eli/udev (60-eli.rules).
	Names string
	// UdevControl exists while udev runs.
	UdevControl string
	// Rules are the places eli's rule may be installed; Name waits for udev's link only
	// if one exists.
	Rules []string
}

// System is the real machine.
var System = Host{
	Sys: "/sys", Dev: "/dev", Names: "/run/eli/udev", UdevControl: "/run/udev/control",
	Rules: []string{"/etc/udev/rules.d/60-eli.rules", "/usr/lib/udev/rules.d/60-eli.rules", "/lib/udev/rules.d/60-eli.rules"},
}

// Dir is the directory of the names.
const Dir = "eli"

// Named is a device that Name named.
type Named struct {
	h       Host
	name    string
	idx     int
	backend string
	// Link is the name, /dev/eli/NAME.
	Link string
	// own: Name made the link itself, without udev.
	own bool
}

// Name makes Link (/dev/eli/NAME) name /dev/nbd<idx>, which serves the volume whose
// backend identifier is backend. With udev and eli's rule it waits up to wait for udev
// to make the link, and returns an error (the device still serves) if udev does not.
func (h Host) Name(name string, idx int, backend string, wait time.Duration) (*Named, error) {
	if name == "" || strings.ContainsAny(name, "/\n\x00") || name == "." || name == ".." {
		return nil, fmt.Errorf("%q cannot name a device", name)
	}
	if backend == "" || strings.ContainsAny(backend, "/\n\x00") {
		return nil, fmt.Errorf("backend identifier %q cannot name a file", backend)
	}
	n := &Named{h: h, name: name, idx: idx, backend: backend, Link: filepath.Join(h.Dev, Dir, name)}
	if _, err := os.Stat(h.UdevControl); err != nil {
		n.own = true
		return n, n.link()
	}
	if err := os.MkdirAll(h.Names, 0o755); err != nil {
		return n, err
	}
	if err := writeAtomic(filepath.Join(h.Names, backend), []byte("ELI_NAME="+name+"\n")); err != nil {
		return n, err
	}
	// The kernel announced the device when it was connected, likely before the name
	// was written: ask udev to look again (a "change" uevent, as udevadm trigger does).
	if err := os.WriteFile(filepath.Join(h.Sys, "block", fmt.Sprintf("nbd%d", idx), "uevent"), []byte("change"), 0o200); err != nil {
		return n, fmt.Errorf("ask udev to name /dev/nbd%d: %w", idx, err)
	}
	if !h.ruleInstalled() {
		return n, fmt.Errorf("eli's udev rule (60-eli.rules) is not installed: no %s", n.Link)
	}
	target := filepath.Join(h.Dev, fmt.Sprintf("nbd%d", idx))
	deadline := time.Now().Add(wait)
	for {
		if got, err := filepath.EvalSymlinks(n.Link); err == nil && got == target {
			return n, nil
		}
		if time.Now().After(deadline) {
			return n, fmt.Errorf("udev did not make %s within %v", n.Link, wait)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (h Host) ruleInstalled() bool {
	for _, r := range h.Rules {
		if _, err := os.Stat(r); err == nil {
			return true
		}
	}
	return false
}

// link makes Link point at the device, replacing whatever was there.
func (n *Named) link() error {
	dir := filepath.Dir(n.Link)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(dir, "."+n.name+".tmp")
	os.Remove(tmp)
	if err := os.Symlink(fmt.Sprintf("../nbd%d", n.idx), tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, n.Link); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// Release forgets the name when the server stops, unless the device still belongs to
// this volume (left connected for the next server, which re-plugs it): then the name
// stays with it. udev drops its link by itself once the device disconnects.
func (n *Named) Release() {
	if n == nil || n.stillOurs() {
		return
	}
	if n.own {
		if t, err := os.Readlink(n.Link); err == nil && t == fmt.Sprintf("../nbd%d", n.idx) {
			os.Remove(n.Link)
		}
		return
	}
	p := filepath.Join(n.h.Names, n.backend)
	if b, err := os.ReadFile(p); err == nil && string(b) == "ELI_NAME="+n.name+"\n" {
		os.Remove(p)
	}
}

// stillOurs reports whether the device is still connected to this volume's backend.
func (n *Named) stillOurs() bool {
	dir := filepath.Join(n.h.Sys, "block", fmt.Sprintf("nbd%d", n.idx))
	if _, err := os.Stat(filepath.Join(dir, "pid")); errors.Is(err, os.ErrNotExist) {
		return false
	}
	b, err := os.ReadFile(filepath.Join(dir, "backend"))
	return err == nil && strings.TrimSpace(string(b)) == n.backend
}

// writeAtomic replaces path with data, so that udev never reads half a file.
func writeAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

package elidev

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeHost is a machine of files: nbd3 connected to backend eli:ab.
func fakeHost(t *testing.T, udev, rule bool) Host {
	t.Helper()
	root := t.TempDir()
	h := Host{Sys: filepath.Join(root, "sys"), Dev: filepath.Join(root, "dev"), Names: filepath.Join(root, "run/eli/udev"),
		UdevControl: filepath.Join(root, "run/udev/control"), Rules: []string{filepath.Join(root, "rules/60-eli.rules")}}
	dev := filepath.Join(h.Sys, "block/nbd3")
	os.MkdirAll(dev, 0o755)
	os.MkdirAll(h.Dev, 0o755)
	os.WriteFile(filepath.Join(dev, "pid"), []byte("1\n"), 0o644)
	os.WriteFile(filepath.Join(dev, "backend"), []byte("eli:ab\n"), 0o644)
	os.WriteFile(filepath.Join(h.Dev, "nbd3"), nil, 0o644)
	if udev {
		os.MkdirAll(filepath.Dir(h.UdevControl), 0o755)
		os.WriteFile(h.UdevControl, nil, 0o644)
	}
	if rule {
		os.MkdirAll(filepath.Dir(h.Rules[0]), 0o755)
		os.WriteFile(h.Rules[0], nil, 0o644)
	}
	return h
}

func disconnect(h Host) { os.Remove(filepath.Join(h.Sys, "block/nbd3/pid")) }

// TestNameWithoutUdev: eli makes the link, and takes it away once the device is gone,
// not while the device waits for the next server.
func TestNameWithoutUdev(t *testing.T) {
	t.Parallel()
	h := fakeHost(t, false, false)
	os.MkdirAll(filepath.Join(h.Dev, Dir), 0o755)
	os.Symlink("../nbd9", filepath.Join(h.Dev, Dir, "data")) // a stale link is replaced
	n, err := h.Name("data", 3, "eli:ab", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := filepath.EvalSymlinks(n.Link); err != nil || got != filepath.Join(h.Dev, "nbd3") {
		t.Fatalf("%s -> %s, %v", n.Link, got, err)
	}
	n.Release() // still connected to this volume: kept for the re-plug
	if _, err := os.Lstat(n.Link); err != nil {
		t.Errorf("the name went while the device waits for the next server: %v", err)
	}
	disconnect(h)
	n.Release()
	if _, err := os.Lstat(n.Link); !os.IsNotExist(err) {
		t.Errorf("the name stayed after the device was disconnected: %v", err)
	}
}

// TestNameWithUdev: eli tells the rule the name and triggers a change event; it waits
// for udev's link.
func TestNameWithUdev(t *testing.T) {
	t.Parallel()
	h := fakeHost(t, true, true)
	uevent := filepath.Join(h.Sys, "block/nbd3/uevent")
	os.WriteFile(uevent, nil, 0o644)
	go func() { // udev: on the change event, the link the rule makes
		for {
			if b, _ := os.ReadFile(uevent); string(b) == "change" {
				os.MkdirAll(filepath.Join(h.Dev, Dir), 0o755)
				os.Symlink("../nbd3", filepath.Join(h.Dev, Dir, "data"))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	n, err := h.Name("data", 3, "eli:ab", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	names := filepath.Join(h.Names, "eli:ab")
	if b, err := os.ReadFile(names); err != nil || string(b) != "ELI_NAME=data\n" {
		t.Errorf("the rule's file says %q, %v", b, err)
	}
	n.Release()
	if _, err := os.Stat(names); err != nil {
		t.Errorf("the rule's file went while the device waits for the next server: %v", err)
	}
	disconnect(h)
	n.Release()
	if _, err := os.Stat(names); !os.IsNotExist(err) {
		t.Errorf("the rule's file stayed after the device was disconnected: %v", err)
	}
}

func TestNameFailures(t *testing.T) {
	t.Parallel()
	h := fakeHost(t, true, false)
	os.WriteFile(filepath.Join(h.Sys, "block/nbd3/uevent"), nil, 0o644)
	if _, err := h.Name("data", 3, "eli:ab", time.Second); err == nil || !strings.Contains(err.Error(), "udev rule (60-eli.rules) is not installed") {
		t.Errorf("without the rule: %v", err)
	}
	h = fakeHost(t, true, true)
	os.WriteFile(filepath.Join(h.Sys, "block/nbd3/uevent"), nil, 0o644)
	if _, err := h.Name("data", 3, "eli:ab", 100*time.Millisecond); err == nil || !strings.Contains(err.Error(), "udev did not make") {
		t.Errorf("udev not answering: %v", err)
	}
	for _, bad := range []string{"", "a/b", "..", "x\n"} {
		if _, err := h.Name(bad, 3, "eli:ab", time.Second); err == nil {
			t.Errorf("name %q accepted", bad)
		}
	}
	if _, err := h.Name("data", 3, "../x", time.Second); err == nil {
		t.Error("a backend with a slash accepted")
	}
}

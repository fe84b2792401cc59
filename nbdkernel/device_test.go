package nbdkernel

import (
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

func pipeFiles(t *testing.T, n int) []*os.File {
	t.Helper()
	var fs []*os.File
	for i := 0; i < n; i++ {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close(); w.Close() })
		fs = append(fs, r)
	}
	return fs
}

// decodeTop returns the top-level attributes as raw bytes by type, and the socket fds.
func decodeTop(t *testing.T, b []byte) (map[uint16][]byte, []uint32) {
	t.Helper()
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		t.Fatal(err)
	}
	attrs := map[uint16][]byte{}
	var fds []uint32
	for ad.Next() {
		attrs[ad.Type()] = ad.Bytes()
		if ad.Type() == attrSockets {
			ad.Nested(func(nad *netlink.AttributeDecoder) error {
				for nad.Next() {
					nad.Nested(func(iad *netlink.AttributeDecoder) error {
						for iad.Next() {
							if iad.Type() == sockFD {
								fds = append(fds, iad.Uint32())
							}
						}
						return nil
					})
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	return attrs, fds
}

func TestConnectAttrsDeadConnAndBackend(t *testing.T) {
	t.Parallel()
	b, err := connectAttrs(Config{Index: 0, Size: 8192, BlockSize: 4096, Sockets: pipeFiles(t, 1),
		DeadConnTimeoutSeconds: 60, Backend: "eli:00ff"})
	if err != nil {
		t.Fatal(err)
	}
	attrs, _ := decodeTop(t, b)
	if v := attrs[attrDeadConnTimeout]; len(v) != 8 || binary.NativeEndian.Uint64(v) != 60 {
		t.Errorf("dead-connection timeout attribute = %x, want 60", v)
	}
	// NLA_STRING: the kernel compares it with nla_strcmp, NUL terminator included.
	if v := string(attrs[attrBackend]); v != "eli:00ff\x00" {
		t.Errorf("backend attribute = %q", v)
	}
}

func TestReconfigureAttrs(t *testing.T) {
	t.Parallel()
	socks := pipeFiles(t, 2)
	b, err := reconfigureAttrs(Config{Index: 3, Size: 1 << 20, BlockSize: 512, TimeoutSeconds: 30,
		DeadConnTimeoutSeconds: 60, Backend: "eli:ab", Sockets: socks})
	if err != nil {
		t.Fatal(err)
	}
	attrs, fds := decodeTop(t, b)
	for _, a := range []uint16{attrIndex, attrSizeBytes, attrTimeout, attrDeadConnTimeout, attrBackend, attrSockets} {
		if _, ok := attrs[a]; !ok {
			t.Errorf("attribute %d missing", a)
		}
	}
	if v := attrs[attrSizeBytes]; len(v) != 8 || binary.NativeEndian.Uint64(v) != 1<<20 {
		t.Errorf("size attribute = %x", v)
	}
	// The block size and flags belong to the connect; a reconfigure must not change
	// the block size under a mounted filesystem.
	for _, a := range []uint16{attrBlockSizeBytes, attrClientFlags, attrServerFlags} {
		if _, ok := attrs[a]; ok {
			t.Errorf("attribute %d sent in a reconfigure", a)
		}
	}
	if len(fds) != 2 || fds[0] != uint32(socks[0].Fd()) || fds[1] != uint32(socks[1].Fd()) {
		t.Errorf("socket fds %v", fds)
	}
	if _, err := reconfigureAttrs(Config{Index: -1, Sockets: socks}); err == nil {
		t.Error("reconfigure without an index accepted")
	}
	if _, err := reconfigureAttrs(Config{Index: 0}); err == nil {
		t.Error("reconfigure without sockets accepted")
	}
}

// fakeHost builds a sysfs/procfs/dev tree for nbd<idx>.
func fakeHost(t *testing.T, files map[string]string) host {
	t.Helper()
	root := t.TempDir()
	h := host{sys: filepath.Join(root, "sys"), proc: filepath.Join(root, "proc"), dev: filepath.Join(root, "dev"), self: -1}
	for _, d := range []string{h.sys, h.proc, h.dev} {
		os.MkdirAll(d, 0o755)
	}
	for name, content := range files {
		p := filepath.Join(root, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if strings.HasSuffix(name, "/") {
			continue
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// deadPid returns the pid of a process that has exited and been reaped.
func deadPid(t *testing.T) int {
	t.Helper()
	c := exec.Command("true")
	if err := c.Run(); err != nil {
		t.Skip("cannot run true:", err)
	}
	return c.Process.Pid
}

func TestAttachChoosesConnectOrReplug(t *testing.T) {
	t.Parallel()
	const be = "eli:0102"
	live := strconv.Itoa(os.Getpid())
	dead := strconv.Itoa(deadPid(t))
	for _, tc := range []struct {
		name     string
		files    map[string]string
		backend  string
		want     string // "connect", "replug" or an error substring
		connIdx  int
		replugOK bool
	}{
		{name: "free device", files: map[string]string{"sys/block/nbd2/dev": "43:64"}, backend: be, want: "connect"},
		{name: "dead server, same volume", backend: be, want: "replug",
			files: map[string]string{"sys/block/nbd2/pid": dead, "sys/block/nbd2/backend": be, "sys/block/nbd2/size": "16\n"}},
		{name: "dead server, volume grown", backend: be, want: "replug",
			files: map[string]string{"sys/block/nbd2/pid": dead, "sys/block/nbd2/backend": be, "sys/block/nbd2/size": "8\n"}},
		{name: "dead server, volume shrunk", backend: be, want: "more than the volume's 8192",
			files: map[string]string{"sys/block/nbd2/pid": dead, "sys/block/nbd2/backend": be, "sys/block/nbd2/size": "17\n"}},
		{name: "dead server, other volume", backend: be, want: "another export",
			files: map[string]string{"sys/block/nbd2/pid": dead, "sys/block/nbd2/backend": "eli:ffff"}},
		{name: "connected without backend", backend: be, want: "another export",
			files: map[string]string{"sys/block/nbd2/pid": dead}},
		{name: "no backend asked", backend: "", want: "another export",
			files: map[string]string{"sys/block/nbd2/pid": dead, "sys/block/nbd2/backend": ""}},
		{name: "live server", backend: be, want: "still served by pid " + live,
			files: map[string]string{"sys/block/nbd2/pid": live, "sys/block/nbd2/backend": be}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := fakeHost(t, tc.files)
			var called string
			idx, replugged, err := h.attach(Config{Index: 2, Size: 8192, Backend: tc.backend},
				func(Config) (int, error) { called = "connect"; return 2, nil },
				func(c Config) error {
					called = "replug"
					if c.Index != 2 {
						t.Errorf("reconfigure of index %d", c.Index)
					}
					return nil
				})
			switch tc.want {
			case "connect", "replug":
				if err != nil || called != tc.want || idx != 2 || replugged != (tc.want == "replug") {
					t.Errorf("got idx %d replugged %v err %v called %q; want %s", idx, replugged, err, called, tc.want)
				}
			default:
				if err == nil || !strings.Contains(err.Error(), tc.want) || called != "" {
					t.Errorf("got err %v, called %q; want an error containing %q and no call", err, called, tc.want)
				}
			}
		})
	}
}

func TestAttachReplugError(t *testing.T) {
	t.Parallel()
	h := fakeHost(t, map[string]string{"sys/block/nbd0/pid": strconv.Itoa(deadPid(t)), "sys/block/nbd0/backend": "eli:1"})
	_, _, err := h.attach(Config{Index: 0, Backend: "eli:1"},
		func(Config) (int, error) { t.Error("connect called"); return 0, nil },
		func(Config) error { return unix.EINVAL })
	if !errors.Is(err, unix.EINVAL) || !strings.Contains(err.Error(), "re-plug /dev/nbd0") {
		t.Errorf("err = %v", err)
	}
}

func TestTune(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ hw, want int }{{32768, MaxSectorsKiB}, {512, 512}} {
		h := fakeHost(t, map[string]string{
			"sys/block/nbd1/queue/max_hw_sectors_kb": strconv.Itoa(tc.hw) + "\n",
			"sys/block/nbd1/queue/max_sectors_kb":    "128\n",
		})
		got, err := h.tune(1, MaxSectorsKiB)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(h.block(1, "queue/max_sectors_kb"))
		if got != tc.want || string(b) != strconv.Itoa(tc.want) {
			t.Errorf("hw %d: tune = %d, file %q; want %d", tc.hw, got, b, tc.want)
		}
	}
	if _, err := fakeHost(t, nil).tune(1, 1024); err == nil {
		t.Error("tune of a missing device succeeded")
	}
}

// sampleMountinfo mounts nbd0 (43:0) twice and a partition of it once.
const sampleMountinfo = `22 1 0:21 / /proc rw,nosuid - proc proc rw
36 22 43:0 / /mnt/with\040space rw,relatime shared:1 - ext4 /dev/nbd0 rw
37 22 43:1 / /other rw - ext4 /dev/nbd0p1 rw
38 22 43:0 /sub /bind rw - ext4 /dev/nbd0 rw
`

func TestInUseFake(t *testing.T) {
	t.Parallel()
	busy := fakeHost(t, map[string]string{
		"sys/block/nbd0/dev":          "43:0\n",
		"sys/block/nbd0/holders/dm-0": "",
		"proc/self/mountinfo":         sampleMountinfo,
	})
	why, err := busy.inUse(0)
	if err != nil {
		t.Fatal(err)
	}
	if why != "mounted on /mnt/with space, mounted on /bind, held by dm-0" {
		t.Errorf("inUse = %q", why)
	}
	idle := fakeHost(t, map[string]string{
		"sys/block/nbd1/dev":      "43:32\n",
		"sys/block/nbd1/holders/": "",
		"proc/self/mountinfo":     sampleMountinfo,
	})
	if why, err := idle.inUse(1); err != nil || why != "" {
		t.Errorf("idle device: inUse = %q, %v", why, err)
	}
	if why, err := idle.inUse(9); err != nil || why != "" {
		t.Errorf("missing device: inUse = %q, %v", why, err)
	}
	bad := fakeHost(t, map[string]string{"sys/block/nbd0/dev": "garbage"})
	if _, err := bad.inUse(0); err == nil {
		t.Error("unparsable dev accepted")
	}
}

// TestOpeners finds this test process through the real /proc, holding a file open, and
// does not find it when it is the caller's own pid.
func TestOpeners(t *testing.T) {
	t.Parallel()
	f, err := os.Create(filepath.Join(t.TempDir(), "held"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var want unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &want); err != nil {
		t.Fatal(err)
	}
	match := func(st *unix.Stat_t) bool { return st.Dev == want.Dev && st.Ino == want.Ino }
	found := openers("/proc", -1, match)
	if len(found) != 1 || found[0].pid != os.Getpid() || found[0].comm == "" {
		t.Errorf("openers = %+v, want this process (%d)", found, os.Getpid())
	}
	if found := openers("/proc", os.Getpid(), match); len(found) != 0 {
		t.Errorf("openers skipping self = %+v", found)
	}
}

// TestInFlight reads sysfs's inflight (reads and writes) and refuses what is not two
// counts.
func TestInFlight(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		file string
		want int
		ok   bool
	}{
		{"       0        0\n", 0, true},
		{"       3       12\n", 15, true},
		{"3\n", 0, false},
		{"a b\n", 0, false},
		{"1 -1\n", 0, false},
	} {
		h := fakeHost(t, map[string]string{"sys/block/nbd0/inflight": tc.file})
		got, err := h.inFlight(0)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("inflight %q: %d, %v; want %d, ok=%v", tc.file, got, err, tc.want, tc.ok)
		}
	}
	if _, err := fakeHost(t, nil).inFlight(0); err == nil {
		t.Error("no inflight file: no error")
	}
}

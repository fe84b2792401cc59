package nbdkernel

import (
	"encoding/binary"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// socketPair returns the two ends of a unix stream socket pair as files.
func socketPair(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := os.NewFile(uintptr(fds[0]), "a"), os.NewFile(uintptr(fds[1]), "b")
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func TestTimeoutSeconds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   time.Duration
		want uint64
		ok   bool
	}{
		{time.Second, 1, true},
		{1500 * time.Millisecond, 2, true},
		{time.Nanosecond, 1, true},
		{DefaultTimeout, 30, true},
		{MaxTimeout, uint64(MaxTimeout / time.Second), true},
		{0, 0, false},
		{-time.Second, 0, false},
		{MaxTimeout + time.Second, 0, false},
	} {
		got, err := timeoutSeconds(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("timeoutSeconds(%v) = %d, %v; want %d, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
	// Seconds × HZ must fit the kernel's 32-bit jiffies fields at HZ 1000.
	if uint64(MaxTimeout/time.Second)*1000 > 1<<32-1 {
		t.Errorf("MaxTimeout %v overflows 32-bit jiffies at HZ 1000", MaxTimeout)
	}
}

// TestTimeoutAttrs decodes the reconfigure payload as nbd_genl_reconfigure reads it: the
// index, the timeout in seconds, the backend (required for a device that has one), and
// nothing that would change the geometry, the flags or the sockets.
func TestTimeoutAttrs(t *testing.T) {
	t.Parallel()
	b, err := timeoutAttrs(5, "eli:00ff", 86400)
	if err != nil {
		t.Fatal(err)
	}
	attrs, fds := decodeTop(t, b)
	if v := attrs[attrIndex]; len(v) != 4 || binary.NativeEndian.Uint32(v) != 5 {
		t.Errorf("index attribute = %x, want 5", v)
	}
	if v := attrs[attrTimeout]; len(v) != 8 || binary.NativeEndian.Uint64(v) != 86400 {
		t.Errorf("timeout attribute = %x, want 86400", v)
	}
	if v := string(attrs[attrBackend]); v != "eli:00ff\x00" {
		t.Errorf("backend attribute = %q", v)
	}
	for _, a := range []uint16{attrSizeBytes, attrBlockSizeBytes, attrServerFlags, attrClientFlags, attrSockets, attrDeadConnTimeout} {
		if _, ok := attrs[a]; ok {
			t.Errorf("attribute %d sent with a timeout change", a)
		}
	}
	if len(fds) != 0 {
		t.Errorf("sockets %v sent with a timeout change", fds)
	}
	b, err = timeoutAttrs(0, "", 30)
	if err != nil {
		t.Fatal(err)
	}
	if attrs, _ := decodeTop(t, b); attrs[attrBackend] != nil {
		t.Error("an empty backend was sent")
	}
	if _, err := timeoutAttrs(-1, "", 30); err == nil {
		t.Error("a timeout change without an index was accepted")
	}
}

// TestDeviceSetTimeout runs SetTimeout against real sockets (the send timeout is read back
// from the kernel) with the netlink command captured instead of sent.
func TestDeviceSetTimeout(t *testing.T) {
	t.Parallel()
	k1, _ := socketPair(t)
	k2, _ := socketPair(t)
	d, err := NewDevice(3, "eli:ab", []*os.File{k1, k2})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// The Device keeps its own descriptors: the caller closes its files after connecting.
	k1.Close()
	k2.Close()
	var sent [][]byte
	d.execute = func(cmd uint8, attrs []byte) error {
		if cmd != cmdReconfigure {
			t.Errorf("netlink command %d, want NBD_CMD_RECONFIGURE", cmd)
		}
		sent = append(sent, attrs)
		return nil
	}
	if d.Index() != 3 {
		t.Errorf("Index = %d", d.Index())
	}
	for _, want := range []time.Duration{10 * time.Hour, DefaultTimeout} {
		if err := d.SetTimeout(want); err != nil {
			t.Fatal(err)
		}
		got, err := d.SendTimeouts()
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 2 || got[0] != want || got[1] != want {
			t.Errorf("after SetTimeout(%v): send timeouts %v", want, got)
		}
		attrs, _ := decodeTop(t, sent[len(sent)-1])
		if v := attrs[attrTimeout]; len(v) != 8 || binary.NativeEndian.Uint64(v) != uint64(want/time.Second) {
			t.Errorf("after SetTimeout(%v): timeout attribute %x", want, v)
		}
		if v := string(attrs[attrBackend]); v != "eli:ab\x00" {
			t.Errorf("backend attribute = %q", v)
		}
	}

	// Out of range: nothing is changed, nothing is sent.
	n := len(sent)
	if err := d.SetTimeout(0); err == nil || len(sent) != n {
		t.Errorf("SetTimeout(0) = %v, %d commands sent", err, len(sent)-n)
	}
	if got, _ := d.SendTimeouts(); got[0] != DefaultTimeout {
		t.Errorf("a refused SetTimeout changed the send timeout to %v", got[0])
	}

	// A netlink failure is reported, naming what did change.
	d.execute = func(uint8, []byte) error { return unix.ENOENT }
	err = d.SetTimeout(time.Minute)
	if err == nil || !strings.Contains(err.Error(), "/dev/nbd3") || !strings.Contains(err.Error(), "send timeout is set") {
		t.Errorf("SetTimeout with a failing netlink = %v", err)
	}
}

func TestNewDeviceRejects(t *testing.T) {
	t.Parallel()
	k, _ := socketPair(t)
	if _, err := NewDevice(-1, "", []*os.File{k}); err == nil {
		t.Error("a device without an index was accepted")
	}
	if _, err := NewDevice(0, "", nil); err == nil {
		t.Error("a device without sockets was accepted")
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	d, err := NewDevice(0, "", []*os.File{r})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.SetTimeout(time.Minute); err == nil || !strings.Contains(err.Error(), "send timeout") {
		t.Errorf("SetTimeout on a pipe = %v, want the setsockopt failure", err)
	}
}

func TestRequestTimeout(t *testing.T) {
	t.Parallel()
	h := fakeHost(t, map[string]string{"sys/block/nbd4/queue/io_timeout": "30000\n", "sys/block/nbd5/queue/io_timeout": "x"})
	if got, err := h.requestTimeout(4); err != nil || got != 30*time.Second {
		t.Errorf("requestTimeout = %v, %v", got, err)
	}
	if _, err := h.requestTimeout(5); err == nil {
		t.Error("garbage io_timeout accepted")
	}
	if _, err := h.requestTimeout(6); err == nil {
		t.Error("missing device accepted")
	}
}

package sdnotify

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// listen opens a datagram socket as systemd does for a notify service.
func listen(t *testing.T, name string) *net.UnixConn {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func receive(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

func TestNotifyPathAndAbstract(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "notify")
	abstract := fmt.Sprintf("@eli-sdnotify-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	for _, socket := range []string{path, abstract} {
		c := listen(t, socket)
		sent, err := NotifyTo(socket, Ready, Status("serving /dev/nbd0\nat once"))
		if err != nil || !sent {
			t.Fatalf("%s: sent %v, %v", socket, sent, err)
		}
		if got, want := receive(t, c), "READY=1\nSTATUS=serving /dev/nbd0 at once\n"; got != want {
			t.Errorf("%s: received %q, want %q", socket, got, want)
		}
	}
}

func TestNotifyEnvironment(t *testing.T) {
	path := filepath.Join(t.TempDir(), "notify")
	c := listen(t, path)
	t.Setenv(Env, path)
	if sent, err := Notify(Stopping); err != nil || !sent {
		t.Fatalf("sent %v, %v", sent, err)
	}
	if got := receive(t, c); got != "STOPPING=1\n" {
		t.Errorf("received %q", got)
	}
	t.Setenv(Env, "")
	if sent, err := Notify(Ready); sent || err != nil {
		t.Errorf("without %s: sent %v, %v; want nothing done", Env, sent, err)
	}
}

func TestNotifyRefuses(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, tc := range []struct {
		socket string
		msgs   []string
		want   string
	}{
		{"relative/path", []string{Ready}, "neither a path nor an abstract socket"},
		{"@", []string{Ready}, "names no socket"},
		{"vsock:2:1234", []string{Ready}, "neither a path nor an abstract socket"},
		{filepath.Join(dir, "nobody-listens"), []string{Ready}, "no such file"},
		{filepath.Join(dir, "x"), nil, "nothing to send"},
		{filepath.Join(dir, "x"), []string{"READY"}, "not one VAR=value"},
		{filepath.Join(dir, "x"), []string{"READY=1\nSTOPPING=1"}, "not one VAR=value"},
	} {
		sent, err := NotifyTo(tc.socket, tc.msgs...)
		if !sent || err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NotifyTo(%q, %q) = %v, %v; want an error with %q", tc.socket, tc.msgs, sent, err, tc.want)
		}
	}
}

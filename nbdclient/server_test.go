package nbdclient

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// server is an NBD server process (nbdkit or qemu-nbd) that a test can kill -9 and start
// again on the same socket or port.
type server struct {
	t      testing.TB
	argv   []string // program and arguments
	uri    string
	net    string
	addr   string
	cmd    *exec.Cmd
	exited chan struct{}
}

// freePort finds a TCP port for a server to listen on. Another process could take it
// before the server binds it; startServer then fails clearly rather than flaking silently.
func freePort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

// nbdkit serves args (plugin, filters) over "unix" or "tcp"; extra are nbdkit options
// that go before the plugin (e.g. --tls).
func nbdkit(t testing.TB, network string, extra []string, args ...string) *server {
	t.Helper()
	prog := testtool.Need(t, "nbdkit", "nbdkit")
	s := &server{t: t, net: network}
	argv := []string{prog, "--foreground", "--exit-with-parent"}
	if network == "unix" {
		s.addr = filepath.Join(t.TempDir(), "nbd.sock")
		argv = append(argv, "-U", s.addr)
		s.uri = "nbd+unix:///?socket=" + s.addr
	} else {
		port := freePort(t)
		s.addr = "127.0.0.1:" + port
		argv = append(argv, "-i", "127.0.0.1", "-p", port)
		s.uri = "nbd://" + s.addr + "/"
	}
	s.argv = append(append(argv, extra...), args...)
	s.start()
	return s
}

// qemuNBD serves a raw image file with qemu-nbd, allowing shared connections; extra
// are more qemu-nbd options.
func qemuNBD(t testing.TB, network, image string, extra ...string) *server {
	t.Helper()
	prog := testtool.Need(t, "qemu-nbd", "qemu-utils")
	s := &server{t: t, net: network}
	argv := []string{prog, "-f", "raw", "--persistent", "--shared=8", "--cache=writeback"}
	if network == "unix" {
		s.addr = filepath.Join(t.TempDir(), "nbd.sock")
		argv = append(argv, "-k", s.addr)
		s.uri = "nbd+unix:///?socket=" + s.addr
	} else {
		port := freePort(t)
		s.addr = "127.0.0.1:" + port
		argv = append(argv, "-b", "127.0.0.1", "-p", port)
		s.uri = "nbd://" + s.addr + "/"
	}
	s.argv = append(append(argv, extra...), image)
	s.start()
	return s
}

func (s *server) start() {
	s.t.Helper()
	cmd := exec.Command(s.argv[0], s.argv[1:]...)
	// The server's messages (nbdkit's error filter is chatty) go to a file, shown only
	// if the test fails.
	logf, err := os.CreateTemp(s.t.TempDir(), "server-*.log")
	if err != nil {
		s.t.Fatal(err)
	}
	cmd.Stderr = logf
	s.t.Cleanup(func() {
		logf.Close()
		if s.t.Failed() {
			if b, err := os.ReadFile(logf.Name()); err == nil && len(b) > 0 {
				s.t.Logf("%s said:\n%s", filepath.Base(s.argv[0]), b[max(0, len(b)-4096):])
			}
		}
	})
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	s.cmd = cmd
	s.t.Cleanup(func() { s.kill() })
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		select {
		case <-exited:
			s.cmd = nil
			s.t.Fatalf("%v exited before serving", s.argv)
		default:
		}
		if c, err := net.DialTimeout(s.net, s.addr, time.Second); err == nil {
			c.Close()
			// Keep the waiter: kill uses Process.Kill and this channel.
			s.exited = exited
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.t.Fatalf("%v did not start listening on %s", s.argv, s.addr)
}

// kill stops the server at once (SIGKILL, like a crash) and waits for it.
func (s *server) kill() {
	if s.cmd == nil {
		return
	}
	s.cmd.Process.Kill()
	<-s.exited
	s.cmd = nil
	if s.net == "unix" {
		os.Remove(s.addr)
	}
}

func (s *server) String() string { return fmt.Sprint(s.argv) }

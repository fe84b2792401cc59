// Package sdnotify tells systemd how a service is doing: the sd_notify(3) protocol, one
// datagram of newline-separated VAR=value assignments sent to the unix socket named by
// $NOTIFY_SOCKET (a path, or an abstract address when it starts with '@'). Outside a
// Type=notify service the variable is unset and every call does nothing.
//
// The protocol is small enough that eli speaks it itself rather than linking a library:
// see systemd's sd_notify(3), "NOTES" (the socket and its address forms).
package sdnotify

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
)

// Env is the variable that names the socket.
const Env = "NOTIFY_SOCKET"

// Messages eli sends (sd_notify(3), "WELL-KNOWN ASSIGNMENTS").
const (
	Ready    = "READY=1"
	Stopping = "STOPPING=1"
)

// Status is the one-line status text `systemctl status` shows.
func Status(text string) string {
	return "STATUS=" + strings.ReplaceAll(text, "\n", " ")
}

// Notify sends the assignments as one datagram to $NOTIFY_SOCKET. It reports whether
// a socket was named: false, with a nil error, outside a notify service.
func Notify(assignments ...string) (bool, error) {
	return NotifyTo(os.Getenv(Env), assignments...)
}

// NotifyTo is Notify with the socket given: a file system path or "@name" for an
// abstract socket. An empty socket does nothing.
func NotifyTo(socket string, assignments ...string) (bool, error) {
	if socket == "" {
		return false, nil
	}
	if len(assignments) == 0 {
		return true, errors.New("sdnotify: nothing to send")
	}
	for _, a := range assignments {
		if !strings.Contains(a, "=") || strings.Contains(a, "\n") {
			return true, fmt.Errorf("sdnotify: %q is not one VAR=value assignment", a)
		}
	}
	addr, err := address(socket)
	if err != nil {
		return true, err
	}
	c, err := net.DialUnix("unixgram", nil, addr)
	if err != nil {
		return true, fmt.Errorf("sdnotify: %s: %w", socket, err)
	}
	defer c.Close()
	if _, err := c.Write([]byte(strings.Join(assignments, "\n") + "\n")); err != nil {
		return true, fmt.Errorf("sdnotify: %s: %w", socket, err)
	}
	return true, nil
}

// address maps $NOTIFY_SOCKET to a unix address: '@' at the start names the abstract
// namespace (Go's net package spells that '@' too and puts the NUL in its place);
// anything else must be an absolute path.
func address(socket string) (*net.UnixAddr, error) {
	switch {
	case strings.HasPrefix(socket, "@"):
		if len(socket) < 2 {
			return nil, fmt.Errorf("sdnotify: %s=%q names no socket", Env, socket)
		}
	case strings.HasPrefix(socket, "/"):
	default:
		// systemd also passes vsock: addresses to VMs; eli runs on the host it serves.
		return nil, fmt.Errorf("sdnotify: %s=%q is neither a path nor an abstract socket", Env, socket)
	}
	return &net.UnixAddr{Name: socket, Net: "unixgram"}, nil
}

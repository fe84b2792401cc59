//go:build !linux

package nbd

import "net"

// newRawConn: raw system calls are used on Linux only (rawconn_linux.go).
func newRawConn(c net.Conn) net.Conn { return c }

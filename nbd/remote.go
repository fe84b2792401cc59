package nbd

import "net"

// remoteName names the peer for the log: for a unix socket (whose peer is usually
// unnamed) the process and user the kernel reports where it can, else the address.
func remoteName(nc net.Conn) string {
	if uc, ok := nc.(*net.UnixConn); ok {
		if s, ok := peerCred(uc); ok {
			return s
		}
	}
	if a := nc.RemoteAddr(); a != nil && a.String() != "" && a.String() != "@" {
		return a.String()
	}
	return "unknown"
}

package nbd

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

func peerCred(uc *net.UnixConn) (string, bool) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return "", false
	}
	var cred *unix.Ucred
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		cred, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil || gerr != nil {
		return "", false
	}
	return fmt.Sprintf("unix:pid=%d,uid=%d", cred.Pid, cred.Uid), true
}

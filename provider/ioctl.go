package provider

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// ioctlPtr issues an ioctl whose argument is a pointer to a small struct.
func ioctlPtr[T any](fd int, req uint, arg *T) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(unsafe.Pointer(arg)))
	if errno != 0 {
		return errno
	}
	return nil
}

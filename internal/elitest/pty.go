package elitest

import (
	"fmt"
	"os"
	"syscall"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
	"golang.org/x/sys/unix"
)

// OpenPTY returns a pseudo-terminal pair (master, slave), closed when the test ends.
func OpenPTY(t testing.TB) (*os.File, *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		testtool.Missing(t, fmt.Sprintf("pseudo-terminals (/dev/ptmx: %v)", err))
	}
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); s.Close() })
	return m, s
}

package keys

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// ForbidCoreDumps makes the calling process non-dumpable (PR_SET_DUMPABLE 0, which also
// keeps other unprivileged processes from ptrace-attaching to it) and sets RLIMIT_CORE to
// zero, so that keys in its memory never land in a core file. The server process calls it
// once, before it unlocks anything.
func ForbidCoreDumps() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("forbid core dumps: prctl(PR_SET_DUMPABLE): %w", err)
	}
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{Cur: 0, Max: 0}); err != nil {
		return fmt.Errorf("forbid core dumps: setrlimit(RLIMIT_CORE): %w", err)
	}
	return nil
}

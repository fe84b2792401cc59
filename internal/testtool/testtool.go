// Package testtool lets tests that drive external programs (nbdinfo, qemu-img, fio, ...)
// say what they need. Run by hand on a machine without a tool, such a test skips and says
// which package to install; under scripts/test (ELI_REQUIRE_TOOLS=1), which installs every
// tool first, a missing tool fails the test instead, so nothing can skip unnoticed in CI.
package testtool

import (
	"os"
	"os/exec"
	"testing"
)

// Python is the interpreter that has the libnbd bindings (Debian's python3-libnbd installs
// them for the system Python, which may not be the first python3 on PATH).
const Python = "/usr/bin/python3"

func required() bool { return os.Getenv("ELI_REQUIRE_TOOLS") == "1" }

// Need returns the path of program, or stops the test if it is missing.
// pkg names the Debian package that provides it.
func Need(t testing.TB, program, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(program)
	if err != nil {
		Missing(t, program+" (Debian package "+pkg+")")
	}
	return p
}

// NeedPythonNBD stops the test unless Python can import the libnbd bindings.
func NeedPythonNBD(t testing.TB) string {
	t.Helper()
	if err := exec.Command(Python, "-I", "-c", "import nbd; nbd.NBD").Run(); err != nil {
		Missing(t, "python3-libnbd for "+Python)
	}
	return Python
}

// NeedRoot stops the test unless it runs as root (loop devices, mount).
func NeedRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "root privileges")
	}
}

// Missing skips, or under ELI_REQUIRE_TOOLS=1 fails, for want of what.
func Missing(t testing.TB, what string) {
	t.Helper()
	if required() {
		t.Fatalf("missing %s, and ELI_REQUIRE_TOOLS=1 forbids skipping", what)
	}
	t.Skipf("missing %s", what)
}

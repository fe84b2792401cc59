package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// eliBin is the eli binary under test, built once per run from this checkout.
var eliBin string

// workPrefix names every directory this package creates outside t.TempDir (short state
// directories for unix sockets, providers on tmpfs, FUSE mount points). It carries the
// pid of the test process so that sweepStale can tell a dead run's leftovers from a live
// run's.
const workPrefix = "eli-it-"

func TestMain(m *testing.M) {
	sweepStale()
	// ELI_BIN runs the tests against a given binary (an installed or released eli)
	// instead of building this checkout.
	if bin := os.Getenv("ELI_BIN"); bin != "" {
		abs, err := filepath.Abs(bin)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		eliBin = abs
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", workPrefix+fmt.Sprint(os.Getpid())+"-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	eliBin = filepath.Join(dir, "eli")
	build := exec.Command("go", "build", "-o", eliBin, "../cmd/eli")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build eli: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

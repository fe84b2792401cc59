package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/elidisk/eli/internal/elitest"
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
	if eliBin, err = elitest.Build(dir, "../cmd/eli"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

package integration

import (
	"encoding/json"
	"os/exec"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// TestBlockStatusSkipsHoles: eli answers NBD_CMD_BLOCK_STATUS from its records, so real
// clients see never-written sectors as holes that read as zeroes (nbdinfo --map) and
// skip them (nbdcopy reads only what was written), where they used to read all of it.
func TestBlockStatusSkipsHoles(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	testtool.Need(t, "qemu-io", "qemu-utils")
	e := newEnv(t, true)
	img := e.create(volume{name: "bs.img", size: "64M", mode: "xchacha20-poly1305", sector: 4096})
	uri := e.Attach(img)
	defer e.detach("bs.img")
	const mib = 1 << 20
	command(t, time.Minute, "qemu-io", "-f", "raw", "-c", "write -P 90 8M 1M", uri)

	out := command(t, time.Minute, "nbdinfo", "--map", "--json", uri)
	var extents []struct {
		Offset int64 `json:"offset"`
		Length int64 `json:"length"`
		Type   int   `json:"type"`
	}
	if err := json.Unmarshal([]byte(out), &extents); err != nil {
		t.Fatalf("nbdinfo --map --json: %v\n%s", err, out)
	}
	size := nbdInfo(t, uri).Size
	var end int64
	for _, x := range extents {
		if x.Offset != end {
			t.Fatalf("map is not contiguous at %d: %s", end, out)
		}
		end += x.Length
		written := x.Offset < 9*mib && x.Offset+x.Length > 8*mib
		switch {
		case written && (x.Offset != 8*mib || x.Length != mib || x.Type != 0):
			t.Errorf("the written MiB maps as %+v, want [8M, +1M) data", x)
		case !written && x.Type != 3:
			t.Errorf("never-written %+v is not a hole reading as zeroes (type 3)", x)
		}
	}
	if end != size {
		t.Fatalf("map covers %d of %d bytes", end, size)
	}

	before := e.status(t, "bs.img").BytesRead
	command(t, time.Minute, "nbdcopy", uri, "null:")
	time.Sleep(time.Second) // the status file lags the counters by up to a quarter second
	st := e.status(t, "bs.img")
	t.Logf("nbdcopy read %d bytes", st.BytesRead-before)
	if read := st.BytesRead - before; read > 2*mib {
		t.Errorf("nbdcopy of a volume with 1 MiB written read %d bytes from eli: holes were not skipped", read)
	}
}

type statusDoc struct {
	BytesRead uint64 `json:"bytes_read"`
}

func (e *env) status(t *testing.T, name string) statusDoc {
	t.Helper()
	out, err := e.Command("status", "--json", name).Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			t.Fatalf("eli status %s: %v\n%s", name, err, ee.Stderr)
		}
		t.Fatalf("eli status %s: %v", name, err)
	}
	var st statusDoc
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatalf("eli status --json: %v\n%s", err, out)
	}
	return st
}

package integration

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// nbdInfo is what `nbdinfo --json` reports about uri's export.
func nbdInfo(t testing.TB, uri string) testtool.NBDInfoExport {
	t.Helper()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	out, err := exec.Command("nbdinfo", "--json", "--no-content", uri).Output()
	if err != nil {
		t.Fatalf("nbdinfo %s: %v", uri, err)
	}
	var doc testtool.NBDInfo
	if err := json.Unmarshal(out, &doc); err != nil || len(doc.Exports) != 1 {
		t.Fatalf("nbdinfo --json: %v (%d exports)\n%s", err, len(doc.Exports), out)
	}
	return doc.Exports[0]
}

// randomFile writes size bytes from a PRNG seeded with seed to path and returns the
// SHA-256 of those bytes followed by zeroes up to total bytes (what an export of total
// bytes that never saw other writes holds once the file is copied onto it). The data need
// not be secret, only incompressible and reproducible.
func randomFile(t testing.TB, path string, size, total int64, seed uint64) [32]byte {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rng := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24), byte(seed >> 32)})
	h := sha256.New()
	buf := make([]byte, 1<<20)
	for left := size; left > 0; {
		n := min(left, int64(len(buf)))
		rng.Read(buf[:n])
		h.Write(buf[:n])
		if _, err := f.Write(buf[:n]); err != nil {
			t.Fatal(err)
		}
		left -= n
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	clear(buf)
	for left := total - size; left > 0; {
		n := min(left, int64(len(buf)))
		h.Write(buf[:n])
		left -= n
	}
	return [32]byte(h.Sum(nil))
}

// nbdcopyIn copies a local file onto the export with nbdcopy (which opens 4 connections
// when the server advertises multi-conn, as eli does).
func nbdcopyIn(t testing.TB, src, uri string, extra ...string) {
	t.Helper()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	command(t, 2*time.Minute, "nbdcopy", append(extra, src, uri)...)
}

// exportHash reads the whole export out with nbdcopy to a pipe and returns the SHA-256 of
// its contents and their length.
func exportHash(t testing.TB, uri string) ([32]byte, int64) {
	t.Helper()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	cmd := exec.Command("nbdcopy", uri, "-")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(2*time.Minute, func() { cmd.Process.Kill() })
	defer timer.Stop()
	h := sha256.New()
	n, cerr := io.Copy(h, out)
	if err := cmd.Wait(); err != nil || cerr != nil {
		t.Fatalf("nbdcopy %s -: %v %v\n%s", uri, err, cerr, stderr.String())
	}
	return [32]byte(h.Sum(nil)), n
}

// pythonNBD runs testdata/nbdio.py (python3-libnbd, a real libnbd client) with args and
// returns its standard output.
func pythonNBD(t testing.TB, stdin []byte, args ...string) string {
	t.Helper()
	py := testtool.NeedPythonNBD(t)
	cmd := exec.Command(py, append([]string{"testdata/nbdio.py"}, args...)...)
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	timer := time.AfterFunc(time.Minute, func() { cmd.Process.Kill() })
	defer timer.Stop()
	if err := cmd.Run(); err != nil {
		t.Fatalf("nbdio.py %s: %v\n%s", strings.Join(args, " "), err, errb.String())
	}
	return out.String()
}

// sectorRead is the outcome of reading one sector with libnbd.
type sectorRead struct {
	ok    bool
	hash  [32]byte // of the sector's contents, when ok
	errno string   // Python's errno name (EIO), when not
}

// readSectors reads each of the sectors idx (of size s) on its own, on one connection,
// and reports per sector whether it read and what.
func readSectors(t testing.TB, uri string, s int64, idx ...int64) map[int64]sectorRead {
	t.Helper()
	args := []string{"sectors", uri, fmt.Sprint(s)}
	for _, i := range idx {
		args = append(args, fmt.Sprint(i))
	}
	res := map[int64]sectorRead{}
	sc := bufio.NewScanner(strings.NewReader(pythonNBD(t, nil, args...)))
	for sc.Scan() {
		var i int64
		var status, val string
		if _, err := fmt.Sscan(sc.Text(), &i, &status, &val); err != nil {
			t.Fatalf("nbdio.py: bad line %q", sc.Text())
		}
		r := sectorRead{ok: status == "ok"}
		if r.ok {
			var b []byte
			if _, err := fmt.Sscanf(val, "%x", &b); err != nil || len(b) != 32 {
				t.Fatalf("nbdio.py: bad hash in %q", sc.Text())
			}
			r.hash = [32]byte(b)
		} else {
			r.errno = val
		}
		res[i] = r
	}
	if len(res) != len(idx) {
		t.Fatalf("nbdio.py answered for %d of %d sectors", len(res), len(idx))
	}
	return res
}

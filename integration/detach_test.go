package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// TestDetachReportsFailure (issue 17): a provider that runs out of space under a volume.
// The provider lives on a 6 MiB tmpfs and the volume is 64 MiB; filling it makes a commit
// fail with ENOSPC. Then list shows the volume failed, status says why, detach exits 1
// with one line saying what failed and what the data is worth, the server's log never
// says "attach failed", and the state directory keeps the log and final status until the
// next attach. Once there is space again the next attach recovers, with everything that
// was flushed before the failure intact.
func TestDetachReportsFailure(t *testing.T) {
	t.Parallel()
	testtool.NeedRoot(t)
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	e := newEnv(t, false)
	mnt := e.mkdirTemp("", "tmpfs")
	command(t, time.Minute, "mount", "-t", "tmpfs", "-o", "size=6M,mode=0700", "tmpfs", mnt)
	t.Cleanup(func() { commandErr(time.Minute, "umount", "-l", mnt) })
	img := mnt + "/full.img"
	e.OK(append(e.initArgs(volume{size: "64M"}), img)...)

	uri := e.Attach(img)
	kept := bytes.Repeat([]byte("flushed before the failure\n"), 4096) // 108 KiB
	const keptAt = 32 << 20                                            // past what nbdcopy writes below
	pythonNBD(t, kept, "pwrite", uri, fmt.Sprint(keptAt))              // written and flushed
	src := e.Path("src")
	if err := os.WriteFile(src, bytes.Repeat([]byte{0x5a}, 16<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := commandErr(time.Minute, "nbdcopy", src, uri); err == nil {
		t.Fatalf("16 MiB onto a 6 MiB tmpfs succeeded:\n%s", out)
	}

	// list and status show the failure (status at once: a failure is written then).
	var entries []struct {
		Name, State, Error string
	}
	if err := json.Unmarshal([]byte(e.OK("list", "--json").Stdout), &entries); err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].State != "failed" || !strings.Contains(entries[0].Error, "no space left") {
		t.Fatalf("eli list --json after ENOSPC: %+v", entries)
	}
	if out := e.OK("list").Stdout; !strings.Contains(out, "failed") {
		t.Errorf("eli list does not show the failed state:\n%s", out)
	}
	var st struct {
		State, Error    string
		Writes, Commits uint64
	}
	// status prints the status, and exits 1 for a failed volume.
	sr := e.Run("", "status", "--json", "full.img")
	if sr.Code != 1 || !strings.Contains(sr.Stderr, "no space left") {
		t.Errorf("eli status of a failed volume: want exit 1 and the failure on stderr: %v", sr)
	}
	if err := json.Unmarshal([]byte(sr.Stdout), &st); err != nil {
		t.Fatal(err)
	}
	if st.State != "failed" || !strings.Contains(st.Error, "no space left") || st.Writes == 0 || st.Commits == 0 {
		t.Errorf("eli status --json after ENOSPC: %+v", st)
	}

	r := e.FailsCode(1, "no space left on device", "detach", "full.img")
	for _, want := range []string{"full.img", "flushed before the failure is safe", "journal"} {
		if !strings.Contains(r.Stderr, want) {
			t.Errorf("detach's message lacks %q: %s", want, r.Stderr)
		}
	}
	log := e.serverLog("full.img")
	if strings.Contains(log, "attach failed") || !strings.Contains(log, "no space left") {
		t.Errorf("server log after a failed detach:\n%s", log)
	}
	var left []string
	ents, _ := os.ReadDir(e.State)
	for _, ent := range ents {
		left = append(left, ent.Name())
	}
	if got := strings.Join(left, " "); got != "full.img.log full.img.status" {
		t.Errorf("state directory after the failed detach: %s; want the log and the status", got)
	}
	if r := e.Run("", "status", "full.img"); r.Code != 1 || !strings.Contains(r.Stdout, "stopped") || !strings.Contains(r.Stdout, "no space left") {
		out := r.String()
		t.Errorf("status of the stopped, failed server:\n%s", out)
	}

	// Space again: the next attach recovers, and what was flushed is there.
	command(t, time.Minute, "mount", "-o", "remount,size=128M", mnt)
	uri = e.Attach(img)
	if got := pythonNBD(t, nil, "pread", uri, fmt.Sprint(keptAt), fmt.Sprint(len(kept))); got != string(kept) {
		t.Error("data flushed before the failure is not intact after re-attach")
	}
	if log := e.serverLog("full.img"); strings.Contains(log, "no space left") {
		t.Errorf("the new server's log still holds the old one's:\n%s", log)
	}
	e.detach("full.img")
	if ents, _ := os.ReadDir(e.State); len(ents) != 0 {
		t.Errorf("state directory after a clean detach: %v", ents)
	}
}

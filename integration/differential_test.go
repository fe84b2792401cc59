package integration

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// TestDifferential checks eli against a server we did not write, nbdkit's file plugin on
// a plain file, as the oracle: testdata/nbddiff.py (libnbd) sends both the same random
// requests, aligned and not, and demands the same bytes back from every read; then it
// writes disjoint pieces of one region through four connections at once, most of them
// partial sectors shared with other pieces in flight, and demands that none is lost; and
// finally it compares the whole exports after a flush on a fresh connection, and holds
// every extent that eli's block status calls zero to reading as zeroes; then once more
// after a detach and a read-only attach.
func TestDifferential(t *testing.T) {
	t.Parallel()
	py := testtool.NeedPythonNBD(t)
	configs := []struct {
		mode   string
		sector int
		extra  []string
		remote string // the provider: a file, or an export of this storage server
	}{
		{"xchacha20-poly1305", 4096, nil, ""},
		{"xchacha20-poly1305", 512, []string{"--format", "1", "--journal-size", "64K"}, ""},
		{"xchacha20-poly1305", 65536, nil, ""},
		{"aes-xts", 4096, nil, ""},
		{"chacha20-xts", 512, nil, ""},
		{"none", 4096, nil, ""},
		{"xchacha20-poly1305", 4096, nil, "qemu-nbd"},
	}
	for k, cfg := range configs {
		t.Run(fmt.Sprintf("%s/%d/%s%s", cfg.mode, cfg.sector, strings.Join(cfg.extra, ""), cfg.remote), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, true)
			var img, uri string
			if cfg.remote != "" {
				img = newStorage(e, cfg.remote, 40<<20, nil, nil).uri
				e.remoteInit(img, "--sector-size", fmt.Sprint(cfg.sector))
				uri = e.Attach(img, "--name", "d.img")
			} else {
				img = e.create(volume{name: "d.img", size: "40M", mode: cfg.mode, sector: cfg.sector, extra: cfg.extra})
				uri = e.Attach(img)
			}
			ref := newStorage(e, "nbdkit", nbdInfo(t, uri).Size, nil, nil)

			nbddiff(t, e, py, uri, ref.uri, fmt.Sprint(k+1), "1500", "60")
			e.detach("d.img")
			// What was written and flushed is what a new server serves.
			uri = e.Attach(img, "--readonly", "--name", "d.img")
			nbddiff(t, e, py, "compare", uri, ref.uri)
			e.detach("d.img")
		})
	}
}

// nbddiff runs testdata/nbddiff.py with args and fails t unless it exits 0 within three
// minutes, which it does only when the exports agree.
func nbddiff(t *testing.T, e *env, py string, args ...string) {
	t.Helper()
	out, err := commandErr(3*time.Minute, py, append([]string{"testdata/nbddiff.py"}, args...)...)
	if err != nil {
		t.Fatalf("nbddiff.py %s: %v\n%s\nserver log:\n%s", args[0], err, out, e.serverLog("d.img"))
	}
	t.Log(strings.TrimSpace(out))
}

package daemon

import (
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
)

// TestAutoDetach: a server with AutoDetach serves until its last client disconnects,
// after at least one connected: not before the first, not while one of two remains.
func TestAutoDetach(t *testing.T) {
	t.Parallel()
	path, _, mk := elitest.Volume(t, t.TempDir(), 8<<20, sector.Default)
	defer mk.Wipe()
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	sd := StateDir{Path: shortDir(t)}
	cfg := &Setup{Config: volume.Config{Name: "d", Provider: path, Socket: sd.File("d", ".sock"), AutoDetach: true}}
	_, done := startRun(t, sd, cfg, p, elitest.CopyKey(t, mk))
	stillRuns := func(what string) {
		t.Helper()
		select {
		case err := <-done:
			t.Fatalf("the server stopped %s: %v", what, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	stillRuns("before any client connected")
	a, err := nbdclient.Dial("unix", cfg.Socket, "")
	if err != nil {
		t.Fatal(err)
	}
	b, err := nbdclient.Dial("unix", cfg.Socket, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := a.WriteAt(make([]byte, 4096), 0, true); err != nil {
		t.Fatal(err)
	}
	a.Close()
	stillRuns("with one of its two clients left")
	b.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run after the last client: %v", err)
		}
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("the server did not stop after its last client disconnected")
	}
}

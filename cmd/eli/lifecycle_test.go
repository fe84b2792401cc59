package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/volume"
)

// TestFailedAttachFreesName: an attach that fails in the background server returns only
// once the server has let go of the name and the provider, so that the very next attach
// (or this check) finds both free. Repeated, because the wrong order loses a race.
func TestFailedAttachFreesName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("f.img", "16M")
	sd := daemon.StateDir{Path: e.State}
	for i := 0; i < 5; i++ {
		e.FailsCode(1, "listen", "attach", "--passphrase-file", e.Pass, "--socket", "/proc/eli-cannot-be-here.sock", img)
		l, err := sd.LockName("f.img")
		if err != nil {
			t.Fatalf("attempt %d: the name is not free when the failed attach returns: %v", i, err)
		}
		p, err := provider.Open(img, false)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Lock(); err != nil {
			t.Fatalf("attempt %d: the provider is not free when the failed attach returns: %v", i, err)
		}
		p.Close()
		l.Release()
	}
	if ents, _ := os.ReadDir(e.State); len(ents) != 1 || ents[0].Name() != "f.img.log" {
		t.Errorf("state directory after failed attaches: %v; want only the failed server's log", ents)
	}
	e.attach(img)
	e.OK("detach", "f.img")
}

// TestStatusAndCleanDetach: eli status counts what the server served (text and JSON),
// list shows the state, and a clean detach leaves nothing in the state directory.
func TestStatusAndCleanDetach(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("st.img", "16M")
	sock := e.attach(img)
	c := dial(t, sock)
	if err := c.WriteAt(make([]byte, 8192), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := c.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	c.Close()
	var st volume.Status
	deadline := time.Now().Add(time.Minute) // hang guard: the status lags by up to 250 ms
	for st.Reads < 1 || st.Writes < 1 || st.Flushes < 1 || st.Commits < 1 {
		if time.Now().After(deadline) {
			t.Fatalf("status never counted the requests: %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
		if err := json.Unmarshal([]byte(e.OK("status", "--json", "st.img").Stdout), &st); err != nil {
			t.Fatal(err)
		}
	}
	if st.State != "serving" || st.Name != "st.img" || st.BytesWritten != 8192 || st.Journal != "zero" {
		t.Errorf("status --json: %+v", st)
	}
	// The background server answers its control socket.
	var live volume.Status
	sd := daemon.StateDir{Path: e.State}
	if err := control.Call(context.Background(), sd.ControlSocket("st.img"), daemon.OpStatus, nil, nil, &live); err != nil ||
		live.Pid != st.Pid || live.State != "serving" || live.Writes != st.Writes || live.Reads != st.Reads {
		t.Errorf("status through the control socket: %+v, %v; the status file says %+v", live, err, st)
	}
	out := e.OK("status", img).Stdout // by provider path
	for _, want := range []string{"state:", "serving", "reads:", "writes:", "flushes:", "auth failures:", "commits:", "journal at attach:", "last error:"} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	if list := e.OK("list").Stdout; !strings.Contains(list, "STATE") || !strings.Contains(list, "serving") {
		t.Errorf("list does not show the state:\n%s", list)
	}
	e.FailsCode(1, "is not attached", "status", "nosuch")

	e.OK("detach", "st.img")
	if ents, _ := os.ReadDir(e.State); len(ents) != 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("state directory after a clean detach: %v", names)
	}
	if _, err := os.Stat(e.State + "/st.img.status"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("status file after detach: %v", err)
	}
	e.FailsCode(1, "is not attached", "status", "st.img")
}

package daemon

import (
	"errors"
	"os"
	"strings"
	"testing"
)

// TestNameLock: a held name is refused to others; Release frees it and removes its file;
// Close (a parent that handed the lock to a child) keeps the file; a lock taken on a file
// its holder removed is not a lock on the name.
func TestNameLock(t *testing.T) {
	// Not parallel: a process that forks (other tests run python and eli) lends its
	// children every open descriptor until they exec, and a lock test's own descriptor
	// lent so would hold its flock a moment longer than the test expects.
	sd := StateDir{Path: shortDir(t)}
	l, err := sd.LockName("a")
	if err != nil {
		t.Fatal(err)
	}
	if !sd.Alive("a") {
		t.Error("a held name is not alive")
	}
	if _, err := sd.LockName("a"); !errors.Is(err, ErrNameTaken) {
		t.Fatalf("second lock of a held name: %v, want ErrNameTaken", err)
	}
	l.Release()
	if sd.Alive("a") {
		t.Error("a released name is alive")
	}
	if _, err := os.Stat(sd.File("a", ".lock")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Release left the lock file: %v", err)
	}

	l, err = sd.LockName("a")
	if err != nil {
		t.Fatal(err)
	}
	// Another process opened the file before the holder removed it, and locks it after:
	// its lock is on a file no longer at the path, so LockName must not hand it out.
	stale, err := os.Open(sd.File("a", ".lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer stale.Close()
	l.Release()
	if samePath(stale, sd.File("a", ".lock")) {
		t.Fatal("the removed lock file is still at its path")
	}
	l2, err := sd.LockName("a")
	if err != nil {
		t.Fatal(err)
	}
	if !samePath(l2.File(), sd.File("a", ".lock")) {
		t.Error("LockName returned a lock on a file that is not at the path")
	}
	l2.Close()
	if _, err := os.Stat(sd.File("a", ".lock")); err != nil {
		t.Errorf("Close removed the lock file: %v", err)
	}
}

// TestLiveCleansDeadServers: list forgets a record whose server is gone and removes its
// socket, record and lock, but keeps a failed server's status and log for the user.
func TestLiveCleansDeadServers(t *testing.T) {
	// Not parallel: a process that forks (other tests run python and eli) lends its
	// children every open descriptor until they exec, and a lock test's own descriptor
	// lent so would hold its flock a moment longer than the test expects.
	sd := StateDir{Path: shortDir(t)}
	live, err := sd.LockName("live")
	if err != nil {
		t.Fatal(err)
	}
	defer live.Release()
	for _, name := range []string{"live", "dead"} {
		if err := sd.WriteRecord(&Record{Name: name, Pid: 1, Socket: sd.File(name, ".sock")}); err != nil {
			t.Fatal(err)
		}
	}
	// The dead one's files, as a killed server leaves them.
	for _, ext := range []string{".lock", ".log", ".status"} {
		if err := os.WriteFile(sd.File("dead", ext), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(sd.File("orphan", ".lock"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	recs, err := sd.Live()
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || recs[0].Name != "live" {
		t.Fatalf("Live = %+v, want just live", recs)
	}
	ents, _ := os.ReadDir(sd.Path)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if got := strings.Join(names, " "); got != "dead.log dead.status live.json live.lock" {
		t.Errorf("state directory after Live: %s", got)
	}
}

// TestRotatingLog: past its limit the log moves to NAME.log.1, replacing the older part,
// and writes go on in a new NAME.log, through the same descriptor.
func TestRotatingLog(t *testing.T) {
	t.Parallel()
	dir := shortDir(t)
	path := dir + "/n.log"
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	l := NewRotatingLog(path, f, 100)
	line := strings.Repeat("x", 39) + "\n"
	for i := 0; i < 10; i++ {
		if _, err := l.Write([]byte(line)); err != nil {
			t.Fatal(err)
		}
	}
	// Lines 1-2 in the first file, 3-4, 5-6, 7-8 and 9-10 in the next ones: two 40-byte
	// lines fit in 100 bytes, the third starts a new file.
	cur, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	old, err := os.ReadFile(path + ".1")
	if err != nil {
		t.Fatal(err)
	}
	if len(cur) != 80 || len(old) != 80 {
		t.Errorf("log %d bytes, older part %d; want 80 and 80", len(cur), len(old))
	}
	if _, err := os.Stat(path + ".2"); err == nil {
		t.Error("more than one older part kept")
	}
}

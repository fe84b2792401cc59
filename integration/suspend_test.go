package integration

import (
	"bytes"
	"crypto/hkdf"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/memscan"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
)

// statusOf is `eli status --json NAME` (whatever its exit: a suspended volume's is 1).
func statusOf(e *env, name string) (st struct {
	State          string    `json:"state"`
	SuspendedSince time.Time `json:"suspended_since"`
	Held           int       `json:"held"`
	Reads          uint64    `json:"reads"`
}) {
	e.t.Helper()
	r := e.Run("", "status", "--json", name)
	if err := json.Unmarshal([]byte(r.Stdout), &st); err != nil {
		e.t.Fatalf("eli status --json %s: %v: %v", name, err, r)
	}
	return st
}

// waitHeld waits until name's server holds n requests (a hang guard).
func waitHeld(e *env, name string, n int) {
	e.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for statusOf(e, name).Held < n {
		if time.Now().After(deadline) {
			e.t.Fatalf("%s holds %d requests, want %d", name, statusOf(e, name).Held, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSuspendResume: eli suspend and eli resume through the binary. A suspended volume
// is listed and shown as suspended (since when, how many requests wait) and status
// exits 1; requests NBD clients send while it is suspended are held, not failed; a
// resume with a wrong passphrase says so and changes nothing (still suspended, every
// request still held and none answered); resume with the right one answers them all
// correctly; detach refuses a suspended volume unless --force, which fails what it
// holds and keeps everything acknowledged before the suspend.
func TestSuspendResume(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	img := e.create(volume{name: "s.img", size: "16M"})
	uri := e.Attach(img)
	c := dialURI(t, uri)
	defer c.Close()
	a, b := bytes.Repeat([]byte{0xa5}, 128<<10), bytes.Repeat([]byte{0x5b}, 64<<10)
	if err := c.WriteAt(a, 0, false); err != nil { // acknowledged, never flushed
		t.Fatal(err)
	}

	e.OK("suspend", "s.img")
	if l := listed(e); len(l) != 1 || l[0].State != "suspended" {
		t.Fatalf("list of a suspended volume: %+v", l)
	}
	r := e.Run("", "status", "s.img")
	if r.Code != 1 || !strings.Contains(r.Stderr, "suspended since") || !strings.Contains(r.Stderr, "eli resume s.img") {
		t.Fatalf("status of a suspended volume: %v", r)
	}
	if st := statusOf(e, "s.img"); st.State != "suspended" || time.Since(st.SuspendedSince) > time.Hour {
		t.Fatalf("status --json of a suspended volume: %+v", st)
	}
	e.FailsCode(1, "suspended already", "suspend", "s.img")

	// Requests while suspended, on connections of their own.
	var returned atomic.Int32
	results := make(chan error, 3)
	got := make([]byte, len(a))
	for i, f := range []func(*nbdclient.Client) error{
		func(c *nbdclient.Client) error { return c.WriteAt(b, 256<<10, true) },
		func(c *nbdclient.Client) error { return c.ReadAt(got, 0) },
		func(c *nbdclient.Client) error { return c.Flush() },
	} {
		c := dialURI(t, uri)
		defer c.Close()
		go func() {
			err := f(c)
			returned.Add(1)
			if err != nil {
				err = fmt.Errorf("request %d: %w", i, err)
			}
			results <- err
		}()
	}
	waitHeld(e, "s.img", 3)

	wrong := e.Write("wrong", "not the passphrase\n")
	r = e.FailsCode(1, "stays suspended", "resume", "--passphrase-file", wrong, "s.img")
	if !strings.Contains(r.Stderr, "wrong passphrase") {
		t.Errorf("resume with a wrong passphrase does not say so: %v", r)
	}
	time.Sleep(100 * time.Millisecond)
	if st := statusOf(e, "s.img"); st.State != "suspended" || st.Held != 3 || returned.Load() != 0 {
		t.Fatalf("after a wrong passphrase: %+v, %d requests returned", st, returned.Load())
	}

	e.OK("resume", "--passphrase-file", e.Pass, "s.img")
	for range 3 {
		if err := <-results; err != nil {
			t.Error(err)
		}
	}
	if !bytes.Equal(got, a) {
		t.Error("a read held over the suspend returned other data")
	}
	if st := statusOf(e, "s.img"); st.State != "serving" || st.Held != 0 {
		t.Fatalf("after resume: %+v", st)
	}
	e.FailsCode(1, "not suspended", "resume", "--passphrase-file", e.Pass, "s.img")

	// detach of a suspended volume: refused, then forced.
	e.OK("suspend", "s.img")
	held := make(chan error, 1)
	go func() { held <- dialURI(t, uri).WriteAt(bytes.Repeat([]byte{0xee}, 4096), 0, false) }()
	waitHeld(e, "s.img", 1)
	e.FailsCode(1, "eli resume s.img", "detach", "s.img")
	e.FailsCode(1, "eli resume s.img", "stop", "s.img") // geli's name for detach
	e.OK("detach", "--force", "s.img")
	if err := <-held; err == nil {
		t.Error("a write held by a suspended volume succeeded when it was detached")
	}
	uri = e.Attach(img)
	c2 := dialURI(t, uri)
	defer c2.Close()
	all := make([]byte, 320<<10)
	if err := c2.ReadAt(all, 0); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, len(all))
	copy(want, a)
	copy(want[256<<10:], b)
	if !bytes.Equal(all, want) {
		t.Error("after a forced detach of the suspended volume the data is not what was acknowledged before the suspend")
	}
}

// TestSuspendAll: suspend --all suspends every attached volume but a onetime one, which
// it names (its key would be lost), and resume brings each back.
func TestSuspendAll(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	one := e.create(volume{name: "one.img", size: "16M"})
	two := e.create(volume{name: "two.img", size: "16M", mode: "aes-xts"})
	e.Attach(one)
	e.Attach(two)
	scratch := e.Path("scratch.img")
	if err := os.WriteFile(scratch, make([]byte, 16<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	e.OK("onetime", "--name", "scratch", scratch)
	r := e.OK("suspend", "--all")
	if !strings.Contains(r.Stderr, "scratch") || !strings.Contains(r.Stderr, "onetime") {
		t.Errorf("suspend --all does not name the onetime volume it leaves: %v", r)
	}
	states := map[string]string{}
	for _, l := range listed(e) {
		states[l.Name] = l.State
	}
	if states["one.img"] != "suspended" || states["two.img"] != "suspended" || states["scratch"] != "serving" {
		t.Fatalf("after suspend --all: %v", states)
	}
	e.FailsCode(1, "onetime", "suspend", "scratch")
	e.OK("suspend", "--all") // nothing left to suspend: not an error
	e.OK("resume", "--passphrase-file", e.Pass, "one.img")
	e.OK("resume", "--passphrase-file", e.Pass, two) // by provider
	for _, l := range listed(e) {
		if l.State != "serving" {
			t.Errorf("%s is %s after resume", l.Name, l.State)
		}
	}
}

// TestSuspendKill9: a server killed with SIGKILL while suspended loses nothing it
// acknowledged before the suspend, flushed or not: the suspend committed and flushed
// everything, and left nothing for the next attach to recover.
func TestSuspendKill9(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	img := e.create(volume{name: "k.img", size: "16M"})
	uri := e.Attach(img)
	c := dialURI(t, uri)
	flushed, unflushed := bytes.Repeat([]byte{1}, 64<<10), bytes.Repeat([]byte{2}, 64<<10)
	if err := c.WriteAt(flushed, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := c.WriteAt(unflushed, 64<<10, false); err != nil {
		t.Fatal(err)
	}
	c.Close()
	e.OK("suspend", "k.img")
	pid := e.Attached("k.img").Pid
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); alive(e, pid) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	uri = e.Attach(img)
	c = dialURI(t, uri)
	defer c.Close()
	got := make([]byte, 128<<10)
	if err := c.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:64<<10], flushed) || !bytes.Equal(got[64<<10:], unflushed) {
		t.Fatal("a server killed while suspended lost writes it acknowledged before the suspend")
	}
	var st struct {
		Journal string `json:"journal"`
	}
	if err := json.Unmarshal([]byte(e.OK("status", "--json", "k.img").Stdout), &st); err != nil || st.Journal != "empty" {
		t.Errorf("journal at the attach after the kill: %q, %v; want empty (the suspend left nothing to recover)", st.Journal, err)
	}
}

// volumeKeys are the keys a server of the volume at img derives, computed here from its
// header and passphrase: the master key through package keys, the rest from the master
// key as docs/format.md ("Keys") defines them, with crypto/hkdf.
func volumeKeys(t *testing.T, img string) (names []string, patterns [][]byte, live int) {
	t.Helper()
	p, err := provider.Open(img, true)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	mk, _, err := h.Unlock(keys.Credentials{Passphrase: []byte(elitest.Passphrase)}, keys.AnySlot)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	add := func(name string, b []byte) {
		names = append(names, name)
		patterns = append(patterns, bytes.Clone(b))
	}
	id := mk.VolumeID()
	expand := func(info string, n int) []byte {
		k, err := hkdf.Key(sha256.New, mk.Bytes(), id[:], info, n)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	// What a serving server holds: the data key (in its codec; XTS keeps each half, the
	// first round key of each of its two AES ciphers, apart) and the journal key.
	data := expand("eli/v1/data", h.Mode.KeySize())
	if len(data) == 64 {
		add("data key, first half", data[:32])
		add("data key, second half", data[32:])
	} else {
		add("data key", data)
	}
	if h.Mode.Authenticated() {
		add("journal key", expand("eli/v1/journal", 32))
	}
	live = len(names)
	// What it computes only while it derives keys, at attach and at resume.
	if len(data) == 64 {
		add("data key", data)
	}
	add("master key", mk.Bytes())
	prk, err := hkdf.Extract(sha256.New, mk.Bytes(), id[:])
	if err != nil {
		t.Fatal(err)
	}
	add("HKDF PRK", prk)
	add("header-MAC key", expand("eli/v1/header-mac", 32))
	return names, patterns, live
}

// TestSuspendWipesKeys: a suspended server's writable memory holds none of the volume's
// keys that docs/threat-model.md ("Suspend") says suspend wipes: the master key, the data
// key (and, for XTS, each of its halves), the journal key, the header-MAC key and the
// HKDF PRK. The same scan finds the data and journal keys while the server serves, before
// the suspend and again after a resume, so it can fail; and the second suspend, after a
// resume that derived every key again from a master key sent over the control socket,
// finds none either.
func TestSuspendWipesKeys(t *testing.T) {
	testtool.NeedRoot(t) // the server is not dumpable: only root reads its memory
	t.Parallel()
	for _, mode := range []string{"xchacha20-poly1305", "aes-xts"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, true)
			name := "m-" + mode
			img := e.create(volume{name: name, size: "16M", mode: mode})
			uri := e.Attach(img)
			c := dialURI(t, uri)
			if err := c.WriteAt(bytes.Repeat([]byte{3}, 1<<20), 0, true); err != nil {
				t.Fatal(err)
			}
			c.Close()
			names, patterns, live := volumeKeys(t, img)
			pid := e.Attached(name).Pid
			scan := func() *memscan.Report {
				t.Helper()
				rep, err := memscan.Scan(pid, patterns...)
				if err != nil {
					t.Fatal(err)
				}
				if len(rep.Unreadable) > 0 {
					t.Logf("unreadable: %v", rep.Unreadable)
				}
				return rep
			}
			serving := func(when string) {
				t.Helper()
				rep := scan()
				for i := range live {
					if !rep.Found(i) {
						t.Errorf("%s: the %s was not found in the serving server: the scan cannot see it", when, names[i])
					}
				}
			}
			suspended := func(when string) {
				t.Helper()
				e.OK("suspend", name)
				for _, m := range scan().Matches {
					t.Errorf("%s: the %s is in the suspended server's memory: %v", when, names[m.Pattern], m)
				}
			}
			serving("after attach")
			suspended("first suspend")
			e.OK("resume", "--passphrase-file", e.Pass, name)
			serving("after resume")
			suspended("suspend after a resume")
			e.OK("resume", "--passphrase-file", e.Pass, name)
		})
	}
}

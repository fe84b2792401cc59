package integration

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/nbdclient"
)

// Scenario 7 (issue 6): bad input through the CLI. Each case exits non-zero with one
// clear line on stderr and changes nothing on disk: every file in the test's directory
// hashes the same before and after, and `eli list` shows the same volumes. Cases that
// cmd/eli/cli_test.go covers already (usage errors, wrong passphrase or keyfile, a file of
// 0xab bytes, a socket under /proc, a second attach without clients, detach of an unknown
// name) are not repeated; these are the ones it lacks.

// badCase is one command that must fail.
type badCase struct {
	name string
	args []string
	want string // in the one line on stderr
}

// dirState is what "changes nothing on disk" compares: the hash of every regular file
// under dir, and the attached volumes.
func (e *env) dirState(dirs ...string) string {
	e.t.Helper()
	var b strings.Builder
	for _, d := range dirs {
		filepath.WalkDir(d, func(p string, de os.DirEntry, err error) error {
			if err != nil {
				e.t.Fatalf("walk %s: %v", p, err)
			}
			if de.Type().IsRegular() {
				fmt.Fprintf(&b, "%s %x\n", p, elitest.FileHash(e.t, p))
			}
			return nil
		})
	}
	var names []string
	for _, r := range e.List() {
		names = append(names, r.Name+" "+r.Socket)
	}
	slices.Sort(names)
	fmt.Fprintf(&b, "attached: %v\n", names)
	return b.String()
}

func (e *env) runBad(cases []badCase) {
	e.t.Helper()
	for _, c := range cases {
		before := e.dirState(e.Dir)
		r := e.Fails(c.want, c.args...)
		if r.Code != 1 {
			e.t.Errorf("%s: exit %d, want 1 (an operational error): %v", c.name, r.Code, r)
		}
		if after := e.dirState(e.Dir); after != before {
			e.t.Errorf("%s changed the disk or the attached volumes:\nbefore:\n%s\nafter:\n%s", c.name, before, after)
		}
	}
}

// TestBadProviders: providers that are not eli volumes, or no longer fit theirs.
func TestBadProviders(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "mkfs.ext4", "e2fsprogs")
	testtool.Need(t, "qemu-img", "qemu-utils")
	testtool.Need(t, "cryptsetup", "cryptsetup-bin")
	e := newEnv(t, false)

	// A volume whose provider shrank under it (truncated by mistake): header copy B and
	// the end of the data area are gone.
	shrunk := e.create(volume{name: "shrunk.img", size: "16M"})
	if err := os.Truncate(shrunk, 8<<20); err != nil {
		t.Fatal(err)
	}
	small := e.Path("small.img")
	if err := os.WriteFile(small, make([]byte, 64<<10), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := e.Path("zero.img")
	if err := os.WriteFile(empty, nil, 0o600); err != nil || os.Truncate(empty, 16<<20) != nil {
		t.Fatalf("create %s: %v", empty, err)
	}
	ext4 := e.Path("ext4.img")
	if err := os.WriteFile(ext4, nil, 0o600); err != nil || os.Truncate(ext4, 16<<20) != nil {
		t.Fatalf("create %s: %v", ext4, err)
	}
	command(t, time.Minute, "mkfs.ext4", "-q", "-F", ext4)
	qcow := e.Path("disk.qcow2")
	command(t, time.Minute, "qemu-img", "create", "-q", "-f", "qcow2", qcow, "16M")
	luks := e.Path("luks.img")
	if err := os.WriteFile(luks, nil, 0o600); err != nil || os.Truncate(luks, 32<<20) != nil {
		t.Fatalf("create %s: %v", luks, err)
	}
	// Cheap PBKDF: the header's content is all that matters here.
	command(t, time.Minute, "cryptsetup", "luksFormat", "-q", "--type", "luks2", "--pbkdf", "pbkdf2",
		"--pbkdf-force-iterations", "1000", "--key-file", e.Pass, luks)

	hdr := make([]byte, 4096)
	if f, err := os.Open(luks); err != nil {
		t.Fatal(err)
	} else if _, err := f.ReadAt(hdr, 0); err != nil {
		t.Fatal(err)
	} else {
		f.Close()
	}
	lukshdr := e.Path("luks.backup")
	if err := os.WriteFile(lukshdr, hdr, 0o600); err != nil {
		t.Fatal(err)
	}

	attach := func(p string) []string { return []string{"attach", "--passphrase-file", e.Pass, p} }
	e.runBad([]badCase{
		{"attach of a shrunk provider", attach(shrunk), "does not fit the provider"},
		{"setkey on a shrunk provider", append([]string{"setkey", "--passphrase-file", e.Pass, "--new-passphrase-file", e.Pass}, append(elitest.QuickKDF, shrunk)...), "does not fit the provider"},
		{"init of an existing provider too small", append([]string{"init", "--passphrase-file", e.Pass}, append(elitest.QuickKDF, small)...), "provider too small"},
		{"init --sector-size 65536 of a 64 KiB provider", append([]string{"init", "--sector-size", "65536", "--passphrase-file", e.Pass}, append(elitest.QuickKDF, small)...), "provider too small"},
		{"attach of an all-zero provider", attach(empty), "not an eli provider"},
		{"attach of an ext4 filesystem", attach(ext4), "not an eli provider"},
		{"attach of a qcow2 image", attach(qcow), "not an eli provider"},
		{"attach of a LUKS2 volume", attach(luks), "LUKS"},
		{"restore of a LUKS header as a backup", []string{"restore", lukshdr, shrunk}, "no eli header"},
		{"attach of a directory", attach(e.Dir), "is a directory"},
		{"attach of a missing provider", attach(e.Path("missing.img")), "no such file"},
		{"detach of a provider that is not attached", []string{"detach", shrunk}, "is not attached"},
	})
	for _, p := range []string{ext4, qcow, luks} {
		if _, err := os.Stat(p + ".sock"); err == nil {
			t.Errorf("a refused attach left a socket for %s", p)
		}
	}
}

// TestBadCredentialsAndSockets: credentials that do not open the volume, and socket paths
// no server can use (or must not take).
func TestBadCredentialsAndSockets(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	e := newEnv(t, false)
	img := e.create(volume{name: "c.img", size: "16M"})
	other := e.create(volume{name: "o.img", size: "16M"})
	key := e.Write("key", "a keyfile the volume never saw")
	notSocket := e.Write("not-a-socket", "must survive")
	otherURI := e.Attach(other)

	// unix(7): sun_path holds 108 bytes with the terminating NUL; clients cannot connect
	// to a longer path, so a server must not claim to listen there.
	long := filepath.Join(e.Dir, strings.Repeat("s", 110)+".sock")
	attach := func(extra ...string) []string {
		return append(append([]string{"attach", "--passphrase-file", e.Pass}, extra...), img)
	}
	e.runBad([]badCase{
		{"an extra keyfile", attach("--keyfile", key), "wrong passphrase or keyfile"},
		{"an empty keyslot", attach("--slot", "3"), "keyslot 3 is empty"},
		{"a missing passphrase file", []string{"attach", "--passphrase-file", e.Path("nope"), img}, "no such file"},
		{"a missing keyfile", attach("--keyfile", e.Path("nokey")), "no such file"},
		{"a socket in a missing directory", attach("--socket", e.Path("no/dir/c.sock")), "no such file or directory"},
		{"a socket path that is a regular file", attach("--socket", notSocket), "not a socket"},
		{"another server's live socket", attach("--socket", elitest.SocketOf(otherURI)), "already listening"},
		{"a socket path longer than unix sockets allow", attach("--socket", long), "too long"},
	})
	// The other server kept its socket and serves.
	if info := nbdInfo(t, otherURI); info.Size <= 0 {
		t.Fatalf("the other server: %+v", info)
	}
	e.detach("o.img")
}

// dialWithData connects to the export at uri and writes and flushes data at offset 8192,
// which the refused commands must leave readable.
func dialWithData(t *testing.T, uri string, data []byte) *nbdclient.Client {
	t.Helper()
	c, err := nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.WriteAt(data, 8192, false); err != nil {
		c.Close()
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		c.Close()
		t.Fatal(err)
	}
	return c
}

// TestBadInputWhileAttached: with a client connected and holding data, nothing another
// eli command does may touch the volume but a re-encryption, which the server runs
// online, and the client keeps working.
func TestBadInputWhileAttached(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false)
	img := e.create(volume{name: "busy.img", size: "16M"})
	backup := e.Path("busy.backup")
	e.OK("backup", img, backup)
	uri := e.Attach(img)
	data := bytes.Repeat([]byte("client data "), 4000)
	c := dialWithData(t, uri, data)
	defer c.Close()

	p := e.Pass
	e.runBad([]badCase{
		{"a second attach", []string{"attach", "--passphrase-file", p, img}, "already attached"},
		{"a second attach under another name", []string{"attach", "--passphrase-file", p, "--name", "other", img}, "in use"},
		{"a second attach on the same socket", []string{"attach", "--passphrase-file", p, "--name", "other", "--socket", elitest.SocketOf(uri), img}, "in use"},
		{"init --force", append([]string{"init", "--force", "--passphrase-file", p}, append(elitest.QuickKDF, img)...), "in use"},
		{"setkey", append([]string{"setkey", "--passphrase-file", p, "--new-passphrase-file", p}, append(elitest.QuickKDF, img)...), "in use"},
		{"delkey", []string{"delkey", "--force", "--slot", "0", img}, "in use"},
		{"kill", []string{"kill", "--yes", img}, "in use"},
		{"restore", []string{"restore", backup, img}, "in use"},
		{"resize", []string{"resize", "--passphrase-file", p, "--size", "32M", img}, "in use"},
		{"onetime", []string{"onetime", "--name", "scratch", img}, "in use"},
	})

	// A re-encryption is the one change that goes to the attached server, which runs it
	// online under the client.
	e.OK("reencrypt", "--passphrase-file", p, img)

	// The client's connection survived all of it.
	got := make([]byte, len(data))
	if err := c.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("client read after the refused commands: %v", err)
	}
	if err := c.WriteAt(data, 1<<20, true); err != nil {
		t.Fatalf("client write after the refused commands: %v", err)
	}
	c.Close()
	e.detach("busy.img")
}

// TestSameVolumeUnderAnotherPath: flock reaches one inode, and a volume has others: a
// loop device over its image file (as a second path to a disk, or a device-mapper
// mapping, would be) and a copy of the file. While the volume is attached, every command
// that writes is refused through the loop device, as through the file itself, and a
// second attach of the copy is refused; nothing changes on disk and the client keeps
// working. Once detached, the loop device and the copy attach.
func TestSameVolumeUnderAnotherPath(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false)
	img := e.create(volume{name: "orig.img", size: "16M"})
	backup := e.Path("orig.backup")
	e.OK("backup", img, backup)
	loop := loopDevice(t, img)
	uri := e.Attach(img)
	data := bytes.Repeat([]byte("written through the file "), 4000)
	c := dialWithData(t, uri, data)
	defer c.Close()
	dup := e.Path("copy.img")
	raw, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dup, raw, 0o600); err != nil {
		t.Fatal(err)
	}

	p := e.Pass
	const want = "already open for writing on this host"
	e.runBad([]badCase{
		{"attach of the loop device", []string{"attach", "--passphrase-file", p, "--name", "aliased", loop}, want},
		{"attach of a copy", []string{"attach", "--passphrase-file", p, "--name", "copy", dup}, want},
		{"init --force", append([]string{"init", "--force", "--passphrase-file", p}, append(elitest.QuickKDF, loop)...), want},
		{"setkey", append([]string{"setkey", "--passphrase-file", p, "--new-passphrase-file", p}, append(elitest.QuickKDF, loop)...), want},
		{"delkey", []string{"delkey", "--force", "--slot", "0", loop}, want},
		{"kill", []string{"kill", "--yes", loop}, want},
		{"restore", []string{"restore", backup, loop}, want},
		{"resize", []string{"resize", "--passphrase-file", p, loop}, want},
		{"reencrypt", []string{"reencrypt", "--passphrase-file", p, loop}, want},
		{"onetime --force", []string{"onetime", "--force", "--name", "scratch", loop}, want},
	})

	got := make([]byte, len(data))
	if err := c.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("client read after the refused commands: %v", err)
	}
	c.Close()
	e.detach("orig.img")

	// Detached, the volume is free under every path, at once.
	uri = e.Attach(loop, "--name", "aliased")
	c, err = nbdclient.Dial("unix", elitest.SocketOf(uri), "")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read through the loop device: %v", err)
	}
	c.Close()
	e.detach("aliased")
	// The copy's generation is behind the volume's witness now: as a volume of its own
	// it needs a witness of its own.
	e.Attach(dup, "--name", "copy", "--witness", e.Path("copy.witness"))
	e.detach("copy")
}

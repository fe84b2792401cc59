package main

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/memscan"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/volume"
)

// blockClient writes random 4 KiB blocks to an attached volume over NBD and flushes every
// few writes, keeping what each block must hold: its value at the last flush that
// returned, or one of those written since (acknowledged or in flight when the server
// died).
type blockClient struct {
	mu      sync.Mutex
	flushed []byte           // every block's value at the last completed flush
	maybe   map[int][][]byte // blocks written since: values a crash may have kept
	stop    chan struct{}
	done    chan error
	writes  int
}

const blockSize = 4096

func newBlockClient(data []byte) *blockClient {
	return &blockClient{flushed: bytes.Clone(data), maybe: map[int][][]byte{}}
}

// run writes until stop or until the connection fails (the server was killed); its
// error is nil then too, unless the failure came while the server should have lived.
func (c *blockClient) run(t *testing.T, socket string, seed uint64) {
	c.stop, c.done = make(chan struct{}), make(chan error, 1)
	cl, err := nbdclient.Dial("unix", socket, "")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer cl.Close()
		rng := rand.New(rand.NewPCG(seed, 3))
		blocks := len(c.flushed) / blockSize
		var since []int
		for n := 0; ; n++ {
			select {
			case <-c.stop:
				c.done <- nil
				return
			default:
			}
			b := rng.IntN(blocks)
			buf := make([]byte, blockSize)
			for i := range buf {
				buf[i] = byte(rng.Uint32())
			}
			c.mu.Lock()
			c.maybe[b] = append(c.maybe[b], buf) // in flight: a crash may keep it
			c.mu.Unlock()
			if err := cl.WriteAt(buf, int64(b)*blockSize, false); err != nil {
				c.done <- err
				return
			}
			since = append(since, b)
			if n%4 != 3 {
				continue
			}
			if err := cl.Flush(); err != nil {
				c.done <- err
				return
			}
			c.mu.Lock()
			for _, b := range since {
				if vs := c.maybe[b]; len(vs) > 0 {
					copy(c.flushed[b*blockSize:], vs[len(vs)-1])
					delete(c.maybe, b)
				}
			}
			c.writes += len(since)
			c.mu.Unlock()
			since = since[:0]
		}
	}()
}

// halt stops the writer and waits for it; a killed server's broken connection is no
// failure when killed is true.
func (c *blockClient) halt(t *testing.T, killed bool) {
	t.Helper()
	close(c.stop)
	if err := <-c.done; err != nil && !killed {
		t.Fatalf("client: %v", err)
	}
}

// check reads every block back and checks it against what it must hold; what it finds
// becomes the block's flushed value.
func (c *blockClient) check(t *testing.T, socket, when string) {
	t.Helper()
	got := readBack(t, socket, len(c.flushed))
	c.mu.Lock()
	defer c.mu.Unlock()
	for b := 0; b < len(c.flushed)/blockSize; b++ {
		g := got[b*blockSize : (b+1)*blockSize]
		ok := bytes.Equal(g, c.flushed[b*blockSize:(b+1)*blockSize])
		for _, v := range c.maybe[b] {
			ok = ok || bytes.Equal(g, v)
		}
		if !ok {
			t.Fatalf("%s: block %d holds neither its last flushed value nor one written since", when, b)
		}
		copy(c.flushed[b*blockSize:], g)
	}
	clear(c.maybe)
}

// reencStatus is eli status --json's re-encryption, nil when there is none. Status
// exits 1 for a volume that does not serve (suspended) and prints it all the same.
func (e *env) reencStatus(name string) *volume.ReencryptStatus {
	e.t.Helper()
	r := e.Run("", "status", "--json", name)
	var st volume.Status
	if err := json.Unmarshal([]byte(r.Stdout), &st); err != nil || r.Code > 1 {
		e.t.Fatalf("eli status --json %s: %v, %v", name, err, r)
	}
	return st.Reencrypt
}

// waitReencrypt polls eli status until name's re-encryption is in state want (and, for
// "running", has moved something).
func (e *env) waitReencrypt(name, want string) *volume.ReencryptStatus {
	e.t.Helper()
	deadline := time.Now().Add(3 * time.Minute) // hang guard
	for {
		r := e.reencStatus(name)
		if r != nil && r.State == want && (want != volume.ReencryptRunning || r.Cursor > 0) {
			return r
		}
		if r != nil && r.State == volume.ReencryptStopped {
			e.t.Fatalf("the re-encryption of %s stopped: %s", name, r.Error)
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("the re-encryption of %s is not %s: %+v", name, want, r)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestReencryptAttached: eli reencrypt of an attached volume while a client writes and
// flushes: the command derives every keyslot's key (and refuses without them), the
// server re-encrypts while it serves, status and list show it, a second reencrypt is
// refused while it runs, and at the end every flushed write is there, the keyslots
// open the new key, the header holds no previous key, and a backup from before is
// refused. Without --detach, reencrypt follows the server's re-encryption to its end.
func TestReencryptAttached(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("on.img", "64M")
	key := e.Write("key.bin", "a keyfile for keyslot 1")
	e.OK(append([]string{"setkey", "--passphrase-file", e.Pass, "--new-keyfile", key, "--new-no-passphrase"}, append(elitest.QuickKDF, img)...)...)
	before := e.Path("before.backup")
	e.OK("backup", img, before)
	sock := e.attach(img)
	c := newBlockClient(writeRandom(t, sock, 48<<20, 4))
	c.run(t, sock, 1)

	e.FailsCode(2, "keyslot 1 (keyfiles) would not open the new master key", "reencrypt", "--passphrase-file", e.Pass, "on.img")
	e.FailsCode(2, "eli init", "reencrypt", "--passphrase-file", e.Pass, "--drop-other-slots", "--cipher", "aes-xts", "on.img")
	e.FailsCode(2, "--max-rate", "reencrypt", "--passphrase-file", e.Pass, "--drop-other-slots", "--max-rate", "fast", "on.img")
	r := e.OK("reencrypt", "--passphrase-file", e.Pass, "--slot-keyfile", "1="+key, "--max-rate", "24M", "--detach", "on.img")
	if !strings.Contains(r.Stdout, "runs in its server") {
		t.Fatalf("reencrypt --detach: %v", r)
	}
	e.FailsCode(1, "under way", "reencrypt", "--passphrase-file", e.Pass, "--slot-keyfile", "1="+key, img) // by provider too
	st := e.waitReencrypt("on.img", volume.ReencryptRunning)
	if st.Epoch != 1 || st.Sectors == 0 {
		t.Fatalf("status while running: %+v", st)
	}
	if out := e.OK("status", "on.img").Stdout; !strings.Contains(out, "re-encryption:") || !strings.Contains(out, "running") {
		t.Errorf("status while re-encrypting:\n%s", out)
	}
	if out := e.OK("list").Stdout; !strings.Contains(out, "re-encrypting") {
		t.Errorf("list while re-encrypting:\n%s", out)
	}
	if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "under way") {
		t.Errorf("dump while re-encrypting:\n%s", dump)
	}
	st = e.waitReencrypt("on.img", volume.ReencryptDone)
	c.halt(t, false)
	if c.writes == 0 || st.Moved == 0 {
		t.Fatalf("the client wrote %d blocks and the sweep moved %d sectors: nothing overlapped", c.writes, st.Moved)
	}
	c.check(t, sock, "after the re-encryption")
	dump := e.OK("dump", img).Stdout
	for _, want := range []string{"key epoch:      1", "re-encryption:  none", "2 active"} {
		if !strings.Contains(dump, want) {
			t.Fatalf("dump lacks %q:\n%s", want, dump)
		}
	}
	if out := e.OK("status", "on.img").Stdout; !strings.Contains(out, "done at") {
		t.Errorf("status after the re-encryption:\n%s", out)
	}

	// Followed to the end, into epoch 2, keeping only the unlocking keyslot.
	r = e.OK("reencrypt", "--passphrase-file", e.Pass, "--drop-other-slots", "on.img")
	if !strings.Contains(r.Stdout, "re-encrypted") || !strings.Contains(r.Stdout, "key epoch 2") {
		t.Fatalf("reencrypt followed to the end: %v", r)
	}
	c.check(t, sock, "after the second re-encryption")
	e.OK("detach", "on.img")
	if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "key epoch:      2") || !strings.Contains(dump, "1 active") {
		t.Fatalf("after the second re-encryption:\n%s", dump)
	}
	e.FailsCode(1, "wrong passphrase or keyfile", "attach", "--keyfile", key, "--no-passphrase", img)
	e.FailsCode(1, "re-encrypted since", "restore", before, img)
	sock = e.attach(img)
	c.check(t, sock, "after a new attach")
	e.OK("detach", "on.img")
}

// TestReencryptAttachedInteractions: what else may happen to a volume while its server
// re-encrypts it. A read-only attach cannot be re-encrypted. A detach stops the
// re-encryption at a checkpoint; a backup taken halfway warns that it holds the previous
// key; restoring a backup from before is refused halfway; resize works halfway (detached); the
// next attach resumes the re-encryption by itself and takes it to the new end; the
// backup from halfway is refused afterwards.
func TestReencryptAttachedInteractions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("ia.img", "64M")
	sock := e.attach(img, "--readonly")
	e.FailsCode(1, "read-only", "reencrypt", "--passphrase-file", e.Pass, "ia.img")
	e.OK("detach", "ia.img")
	sock = e.attach(img)
	data := writeRandom(t, sock, 48<<20, 5)
	before := e.Path("before.backup")
	e.OK("backup", img, before)
	e.OK("reencrypt", "--passphrase-file", e.Pass, "--max-rate", "16M", "--detach", "ia.img")
	e.waitReencrypt("ia.img", volume.ReencryptRunning)
	halfway := e.Path("halfway.backup")
	if r := e.OK("backup", img, halfway); !strings.Contains(r.Stderr, "previous") {
		t.Errorf("a backup halfway does not warn: %v", r)
	}
	e.FailsCode(1, "in use", "resize", "--passphrase-file", e.Pass, "--size", "96M", img) // attached
	e.OK("detach", "ia.img")
	dump := e.OK("dump", img).Stdout
	if !strings.Contains(dump, "under way") {
		t.Fatalf("a detach halfway did not leave the re-encryption under way:\n%s", dump)
	}
	// A backup from before would leave the sectors already moved under a key it lacks.
	e.FailsCode(1, "re-encrypted since", "restore", before, img)
	e.OK("resize", "--passphrase-file", e.Pass, "--size", "96M", img)
	sock = e.attach(img)
	st := e.waitReencrypt("ia.img", volume.ReencryptDone)
	if st.Cursor != st.Sectors || st.Sectors*4096 < 90<<20 {
		t.Fatalf("the resumed re-encryption did not reach the new end: %+v", st)
	}
	got := readBack(t, sock, 90<<20)
	if !bytes.Equal(got[:len(data)], data) {
		t.Fatal("the data changed")
	}
	if !bytes.Equal(got[len(data):], make([]byte, len(got)-len(data))) {
		t.Fatal("the grown area does not read as zeroes")
	}
	e.OK("detach", "ia.img")
	if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "re-encryption:  none") {
		t.Fatalf("after the resumed re-encryption:\n%s", dump)
	}
	e.FailsCode(1, "has finished since", "restore", halfway, img)
}

// TestReencryptAttachedKill9: the server of a volume under re-encryption, with a client
// writing and flushing, killed with SIGKILL at random moments (the first during the
// re-encryption's start): every attach after a kill reads every block as its last
// flushed value or one written since, resumes the re-encryption by itself, and the last
// one finishes it.
func TestReencryptAttachedKill9(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"xchacha20-poly1305", "aes-xts"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			img := e.initVolume("k9.img", "192M", "--cipher", mode)
			sock := e.attach(img)
			c := newBlockClient(writeRandom(t, sock, 160<<20, 6))
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11))
			underWay := func() bool { return strings.Contains(e.OK("dump", img).Stdout, "under way") }
			kills, halfway := 0, 0
			for round := 0; round < 12; round++ {
				c.run(t, sock, uint64(round))
				if round == 0 {
					e.OK("reencrypt", "--passphrase-file", e.Pass, "--max-rate", "24M", "--detach", "k9.img")
				}
				// Round 0 kills at once, within the start's aftermath; later ones anywhere
				// in the sweep, its checkpoints or its end.
				if round > 0 {
					time.Sleep(time.Duration(rng.Int64N(int64(1500 * time.Millisecond))))
				}
				pid := e.Attached("k9.img").Pid
				if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
					t.Fatal(err)
				}
				kills++
				deadline := time.Now().Add(10 * time.Second)
				for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
				c.halt(t, true)
				was := underWay()
				if was {
					halfway++
				}
				// The attach resumes the re-encryption, slowly enough that the next kill
				// lands in it.
				sock = e.attach(img, "--reencrypt-max-rate", "24M")
				c.check(t, sock, "after kill -9")
				if !was {
					break // ended before the kill
				}
			}
			if underWay() {
				e.waitReencrypt("k9.img", volume.ReencryptDone)
			}
			c.check(t, sock, "at the end")
			e.OK("detach", "k9.img")
			if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "re-encryption:  none") || !strings.Contains(dump, "key epoch:      1") {
				t.Fatalf("after the last run:\n%s", dump)
			}
			t.Logf("%d kills, %d during the re-encryption", kills, halfway)
			if halfway < 3 {
				t.Error("fewer than three kills landed in a re-encryption: the test showed little")
			}
		})
	}
}

// TestReencryptAttachedForgetsOldKey: after an attached volume's re-encryption, the
// server's memory holds neither the old journal key nor the new master key (which it
// kept for the header's checkpoints and end); before, the scan finds the old data and
// journal keys there, so that it can fail. The old data key is only counted: the
// XChaCha20 kernels hold a ChaCha state with the key words on the stack of the goroutine
// that seals or opens, and when that stack grows the Go runtime copies it and frees the
// old one unzeroed (docs/threat-model.md, "What suspend cannot wipe": old goroutine
// stacks), which a scan of a process that swept a whole volume finds.
func TestReencryptAttachedForgetsOldKey(t *testing.T) {
	testtool.NeedRoot(t) // reading another process's memory (the server is not dumpable)
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("mem.img", "32M")
	_, oldData, oldJournal := e.volumeKeys(img)
	sock := e.attach(img)
	writeRandom(t, sock, 16<<20, 8)
	pid := e.Attached("mem.img").Pid
	before, err := memscan.Scan(pid, oldData, oldJournal)
	if err != nil {
		t.Fatal(err)
	}
	found := map[int]bool{}
	for _, m := range before.Matches {
		found[m.Pattern] = true
	}
	if !found[0] || !found[1] {
		t.Fatalf("before the re-encryption the scan finds the old data key: %v, journal key: %v; it cannot show their absence", found[0], found[1])
	}
	e.OK("reencrypt", "--passphrase-file", e.Pass, "mem.img")
	newMK, _, _ := e.volumeKeys(img)
	after, err := memscan.Scan(pid, oldData, oldJournal, newMK)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range after.Matches {
		t.Errorf("after the re-encryption the server holds %s: %v", []string{"the old data key", "the old journal key", "the new master key"}[m.Pattern], m)
	}
	e.OK("detach", "mem.img")
}

// volumeKeys unlocks img's header with the test's passphrase and returns copies of its
// master key, data key and journal key.
func (e *env) volumeKeys(img string) (mk, data, journal []byte) {
	t := e.t
	t.Helper()
	h := imageHeader(t, img)
	pass, err := os.ReadFile(e.Pass)
	if err != nil {
		t.Fatal(err)
	}
	k, _, err := h.Unlock(keys.Credentials{Passphrase: bytes.TrimRight(pass, "\n")}, keys.AnySlot)
	if err != nil {
		t.Fatal(err)
	}
	defer k.Wipe()
	dk, jk := k.DataKey(h.Mode), k.JournalKey()
	defer dk.Wipe()
	defer jk.Wipe()
	return bytes.Clone(k.Bytes()), bytes.Clone(dk.Bytes()), bytes.Clone(jk.Bytes())
}

// headerCursor is the re-encryption checkpoint in img's header.
func headerCursor(t *testing.T, img string) uint64 {
	t.Helper()
	return imageHeader(t, img).Reencryption().Cursor
}

// imageHeader reads img's header.
func imageHeader(t *testing.T, img string) *keys.Header {
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
	return h
}

// TestReencryptAttachedSuspend: eli suspend of a volume halfway through an online
// re-encryption records where the sweep stands in the header, and leaves in the server's
// memory neither master key (the new one it kept for the header, the old one it never
// had) nor either journal key; status says suspended and the re-encryption paused, the
// sweep does not move, and a detach is refused; eli resume derives the previous keys
// again and the sweep goes on to the end, every written byte intact.
func TestReencryptAttachedSuspend(t *testing.T) {
	testtool.NeedRoot(t) // reading another process's memory (the server is not dumpable)
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("sus.img", "64M")
	sock := e.attach(img)
	data := writeRandom(t, sock, 48<<20, 9)
	oldMK, _, oldJournal := e.volumeKeys(img)
	e.OK("reencrypt", "--passphrase-file", e.Pass, "--max-rate", "8M", "--detach", "sus.img")
	e.waitReencrypt("sus.img", volume.ReencryptRunning)
	newMK, _, newJournal := e.volumeKeys(img)
	pid := e.Attached("sus.img").Pid
	before, err := memscan.Scan(pid, newMK, newJournal, oldJournal)
	if err != nil {
		t.Fatal(err)
	}
	if !before.Found(0) || !before.Found(1) || !before.Found(2) {
		t.Fatalf("while it re-encrypts the scan finds the new master key %v, the new journal key %v, the old one %v: it cannot show their absence",
			before.Found(0), before.Found(1), before.Found(2))
	}

	e.OK("suspend", "sus.img")
	st := e.reencStatus("sus.img")
	if st == nil || st.State != volume.ReencryptPaused || st.Cursor == 0 || st.Cursor == st.Sectors {
		t.Fatalf("re-encryption while suspended: %+v", st)
	}
	if c := headerCursor(t, img); c != st.Cursor {
		t.Fatalf("the suspend recorded checkpoint %d in the header; the sweep stands at %d", c, st.Cursor)
	}
	after, err := memscan.Scan(pid, newMK, newJournal, oldJournal, oldMK)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range after.Matches {
		t.Errorf("the suspended server holds %s: %v", []string{"the new master key", "the new journal key", "the old journal key", "the old master key"}[m.Pattern], m)
	}
	time.Sleep(time.Second) // at 8 MB/s the sweep would move meanwhile
	if again := e.reencStatus("sus.img"); again.Cursor != st.Cursor {
		t.Fatalf("the sweep moved while suspended: %d, then %d", st.Cursor, again.Cursor)
	}

	e.FailsCode(1, "is suspended", "detach", "sus.img") // as any suspended volume
	e.OK("resume", "--passphrase-file", e.Pass, "sus.img")
	e.OK("reencrypt", "--max-rate", "0", "--detach", "sus.img")
	if r := e.waitReencrypt("sus.img", volume.ReencryptDone); r.Cursor != r.Sectors {
		t.Fatalf("after the resume: %+v", r)
	}
	if got := readBack(t, sock, len(data)); !bytes.Equal(got, data) {
		t.Fatal("the data changed across the suspend")
	}
	e.OK("detach", "sus.img")
	if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "re-encryption:  none") {
		t.Fatalf("after the re-encryption:\n%s", dump)
	}
}

// TestReencryptAttachedKillSuspended: a server killed with SIGKILL while suspended halfway
// through a re-encryption leaves the header's checkpoint where the sweep stood; the next
// attach resumes from there and finishes, every byte intact.
func TestReencryptAttachedKillSuspended(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("ks.img", "64M")
	sock := e.attach(img)
	data := writeRandom(t, sock, 48<<20, 10)
	e.OK("reencrypt", "--passphrase-file", e.Pass, "--max-rate", "8M", "--detach", "ks.img")
	e.waitReencrypt("ks.img", volume.ReencryptRunning)
	e.OK("suspend", "ks.img")
	st := e.reencStatus("ks.img")
	pid := e.Attached("ks.img").Pid
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if c := headerCursor(t, img); c != st.Cursor || c == 0 {
		t.Fatalf("after kill -9 while suspended the header's checkpoint is %d; the sweep stood at %d", c, st.Cursor)
	}
	sock = e.attach(img)
	if r := e.waitReencrypt("ks.img", volume.ReencryptDone); r.Moved > r.Sectors-st.Cursor {
		t.Fatalf("the resumed sweep moved %d sectors, more than the %d left from the checkpoint", r.Moved, r.Sectors-st.Cursor)
	}
	if got := readBack(t, sock, len(data)); !bytes.Equal(got, data) {
		t.Fatal("the data changed")
	}
	e.OK("detach", "ks.img")
}

package main

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
)

// writeRandom fills the first n bytes of an attached volume with random data, flushed,
// and returns them.
func writeRandom(t *testing.T, socket string, n int, seed uint64) []byte {
	t.Helper()
	c := dial(t, socket)
	data := make([]byte, n)
	rng := rand.New(rand.NewPCG(seed, 1))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	for off := 0; off < n; off += 1 << 20 {
		if err := c.WriteAt(data[off:min(n, off+1<<20)], int64(off), false); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	return data
}

func readBack(t *testing.T, socket string, n int) []byte {
	t.Helper()
	c := dial(t, socket)
	defer c.Close()
	got := make([]byte, n)
	for off := 0; off < n; off += 1 << 20 {
		if err := c.ReadAt(got[off:min(n, off+1<<20)], int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	return got
}

// TestReencrypt: eli reencrypt of a detached volume needs every keyslot's credentials
// (or --drop-other-slots), keeps the data, leaves no way to the old key in the header
// (dump says so, a header backup from before is refused), and refuses what cannot be
// done in place.
func TestReencrypt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("re.img", "32M")
	key := e.Write("key.bin", "a keyfile for keyslot 1")
	e.OK(append([]string{"setkey", "--passphrase-file", e.Pass, "--new-keyfile", key, "--new-no-passphrase"}, append(elitest.QuickKDF, img)...)...)
	sock := e.attach(img)
	data := writeRandom(t, sock, 12<<20, 1)
	e.OK("detach", "re.img")
	before := e.Path("before.backup")
	e.OK("backup", img, before)

	e.FailsCode(2, "keyslot 1 (keyfiles) would not open the new master key", "reencrypt", "--passphrase-file", e.Pass, img)
	e.FailsCode(2, "eli init", "reencrypt", "--passphrase-file", e.Pass, "--cipher", "aes-xts", img)
	e.FailsCode(2, "eli init --format 1", "reencrypt", "--passphrase-file", e.Pass, "--format", "1", img)
	e.FailsCode(2, "eli init --sector-size 512", "reencrypt", "--passphrase-file", e.Pass, "--sector-size", "512", img)
	e.FailsCode(2, "want N=FILE", "reencrypt", "--passphrase-file", e.Pass, "--slot-keyfile", "9="+key, img)
	if !strings.Contains(e.OK("dump", img).Stdout, "key epoch:      0") {
		t.Fatal("a refused reencrypt changed the header")
	}

	r := e.OK("reencrypt", "--passphrase-file", e.Pass, "--slot-keyfile", "1="+key, img)
	if !strings.Contains(r.Stdout, "re-encrypted") || !strings.Contains(r.Stdout, "old key is gone") {
		t.Fatalf("reencrypt: %v", r)
	}
	dump := e.OK("dump", img).Stdout
	for _, want := range []string{"key epoch:      1", "re-encryption:  none", "2 active"} {
		if !strings.Contains(dump, want) {
			t.Fatalf("dump lacks %q:\n%s", want, dump)
		}
	}
	sock = e.attach(img)
	if !bytes.Equal(readBack(t, sock, len(data)), data) {
		t.Fatal("the data changed")
	}
	e.OK("detach", "re.img")
	e.OK("attach", "--keyfile", key, "--no-passphrase", img)
	e.OK("detach", "re.img")
	e.FailsCode(1, "re-encrypted since", "restore", before, img)

	// --drop-other-slots keeps only the unlocking keyslot.
	r = e.OK("reencrypt", "--passphrase-file", e.Pass, "--drop-other-slots", img)
	if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "key epoch:      2") || !strings.Contains(dump, "1 active") {
		t.Fatalf("after --drop-other-slots:\n%s", dump)
	}
	e.FailsCode(1, "wrong passphrase or keyfile", "attach", "--keyfile", key, "--no-passphrase", img)
}

// TestReencryptModeChange: a length-preserving volume moves to another
// length-preserving mode in place.
func TestReencryptModeChange(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("xts.img", "16M", "--cipher", "aes128-xts")
	sock := e.attach(img)
	data := writeRandom(t, sock, 8<<20, 2)
	e.OK("detach", "xts.img")
	e.FailsCode(2, "--unsafe", "reencrypt", "--passphrase-file", e.Pass, "--cipher", "chacha20-xts", img)
	e.FailsCode(2, "eli init", "reencrypt", "--passphrase-file", e.Pass, "--cipher", "xchacha20-poly1305", img)
	e.OK("reencrypt", "--passphrase-file", e.Pass, "--cipher", "aes-xts", img)
	if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "mode:           aes-xts") {
		t.Fatalf("dump:\n%s", dump)
	}
	sock = e.attach(img)
	if !bytes.Equal(readBack(t, sock, len(data)), data) {
		t.Fatal("the data changed")
	}
	e.OK("detach", "xts.img")
}

// TestReencryptKill9: eli reencrypt killed with SIGKILL at random moments leaves a volume
// that attaches with every byte, and that the next eli reencrypt resumes and finishes.
func TestReencryptKill9(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"xchacha20-poly1305", "aes-xts"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			img := e.initVolume("k.img", "64M", "--cipher", mode)
			sock := e.attach(img)
			data := writeRandom(t, sock, 40<<20, 3)
			e.OK("detach", "k.img")
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 9))
			// A whole run first, to time the kills: each lands at a random moment of one.
			start := time.Now()
			e.OK("reencrypt", "--passphrase-file", e.Pass, img)
			whole := time.Since(start)
			// The kills' window narrows to where they interrupt one: a run that finished
			// before its kill moves the window's end to that delay, one that had not
			// started the sweep yet (the KDF, the header) moves its start.
			killed, halfway := 0, 0
			lo, hi := whole/20, whole
			for round := 0; round < 16 && halfway < 3; round++ {
				cmd := e.Command("reencrypt", "--passphrase-file", e.Pass, img)
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				delay := lo + time.Duration(rng.Int64N(int64(max(hi-lo, 1))))
				time.Sleep(delay)
				if cmd.Process.Signal(syscall.SIGKILL) == nil {
					killed++
				}
				finished := cmd.Wait() == nil
				switch {
				case strings.Contains(e.OK("dump", img).Stdout, "under way"):
					halfway++
				case finished:
					hi = delay
				default:
					lo = delay
				}
				// Halfway or not, it attaches and reads every byte.
				sock = e.attach(img, "--readonly")
				if !bytes.Equal(readBack(t, sock, len(data)), data) {
					t.Fatalf("round %d: the data read after kill -9 differs", round)
				}
				e.OK("detach", "k.img")
			}
			dump := e.OK("dump", img).Stdout
			r := e.OK("reencrypt", "--passphrase-file", e.Pass, img)
			if strings.Contains(dump, "under way") && !strings.Contains(r.Stderr, "resuming") {
				t.Fatalf("an interrupted re-encryption was not resumed: %v", r)
			}
			if dump := e.OK("dump", img).Stdout; !strings.Contains(dump, "re-encryption:  none") {
				t.Fatalf("after the last run:\n%s", dump)
			}
			sock = e.attach(img)
			if !bytes.Equal(readBack(t, sock, len(data)), data) {
				t.Fatal("the data changed")
			}
			e.OK("detach", "k.img")
			t.Logf("%d kills, %d left the re-encryption halfway", killed, halfway)
			if halfway == 0 {
				t.Error("no kill interrupted a re-encryption: the test showed nothing")
			}
		})
	}
}

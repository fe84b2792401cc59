package integration

import (
	"crypto/sha256"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

// TestFreshnessAttacks replays, zeroes and rolls back what an attacker holding an older
// image of a format version 2 provider can, through the real binary and libnbd, with the
// offsets docs/format.md gives. Every attack ends in EIO for the sectors it concerns or a
// refused attach, never in old data or zeroes served as current, and sectors of other
// groups still read their current data where the design allows. Attacks on the tree and
// the journal are checked with a fresh witness each (--witness), so that what refuses
// them is the tree, not the witness; the whole-provider rollback is the witness's.
func TestFreshnessAttacks(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	e := newEnv(t, false)
	img := e.create(volume{name: "f.img", size: "16M"})
	l := e.dumpLayout(img)
	if l.V != 2 {
		t.Fatalf("default volume is version %d", l.V)
	}
	R := l.perGroup()
	written := 3 * R
	version := func(i int64, v byte) []byte { return sectorVersion(i, l.S, v) }
	old := writeVersionA(t, e, img, "f.img", l.S, written)
	// Version B of two sectors of group 1, flushed: the current state.
	rewritten := []int64{R + 5, R + 20}
	uri := e.Attach(img)
	for _, i := range rewritten {
		pythonNBD(t, version(i, 'B'), "pwrite", uri, fmt.Sprint(i*l.S))
	}
	e.detach("f.img")
	cur, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	want := func(i int64) [32]byte {
		v := byte('A')
		for _, r := range rewritten {
			if r == i {
				v = 'B'
			}
		}
		return sha256.Sum256(version(i, v))
	}
	node1 := l.D + 6*4096 // NodePos(1, 0): the level-1 node above groups 0 to 127
	journal := int64(65536)
	span := func(off, n int64) [2]int64 { return [2]int64{off, n} }

	for k, tc := range []struct {
		name    string
		patch   [][2]int64 // byte ranges of the old image put back
		zero    [][2]int64 // byte ranges zeroed
		badFrom int64      // sectors [badFrom, badTo) must fail with EIO
		badTo   int64
		refuse  bool // the attach itself may be refused instead
	}{
		{name: "replay one sector's data and record", patch: [][2]int64{span(l.dataAt(t, R+5), l.S), span(l.recordAt(t, R+5), recordSize)}, badFrom: R, badTo: 2 * R},
		{name: "replay a whole metadata block", patch: [][2]int64{span(l.blockAt(1), l.metaBlock()), span(l.dataAt(t, R+5), l.S), span(l.dataAt(t, R+20), l.S)}, badFrom: R, badTo: 2 * R},
		{name: "zero a record", zero: [][2]int64{span(l.recordAt(t, R+5), recordSize)}, badFrom: R, badTo: 2 * R},
		{name: "zero a record never rewritten", zero: [][2]int64{span(l.recordAt(t, 2*R+7), recordSize)}, badFrom: 2 * R, badTo: 3 * R},
		{name: "zero a metadata block", zero: [][2]int64{span(l.blockAt(1), l.metaBlock())}, badFrom: R, badTo: 2 * R},
		{name: "zero an interior node", zero: [][2]int64{span(node1, 4096)}, badFrom: 0, badTo: min(128*R, l.N), refuse: true},
		{name: "replay an interior node", patch: [][2]int64{span(node1, 4096)}, badFrom: 0, badTo: min(128*R, l.N), refuse: true},
		{name: "put back an older journal", patch: [][2]int64{span(journal, l.J)}, refuse: true},
	} {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			b := append([]byte(nil), cur...)
			for _, p := range tc.patch {
				copy(b[p[0]:p[0]+p[1]], old[p[0]:p[0]+p[1]])
			}
			for _, z := range tc.zero {
				clear(b[z[0] : z[0]+z[1]])
			}
			name := fmt.Sprintf("atk%d.img", k)
			path := e.Path(name)
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
			r := e.Run("", "attach", "--passphrase-file", e.Pass, "--witness", e.Path(name+".witness"), path)
			if r.Code != 0 {
				if !tc.refuse {
					t.Fatalf("attach refused, but the attack should cost only sectors [%d, %d): %v", tc.badFrom, tc.badTo, r)
				}
				if !strings.Contains(r.Stderr, "tree") && !strings.Contains(r.Stderr, "journal") {
					t.Errorf("refused attach does not say why: %s", r.Stderr)
				}
				return
			}
			defer e.detach(name)
			if tc.badTo == 0 {
				t.Fatalf("attach of %q succeeded: %v", tc.name, r)
			}
			lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
			probe := []int64{0, R - 1, R, R + 5, R + 20, 2*R - 1, 2 * R, 2*R + 7, written - 1, written}
			got := readSectors(t, lines[len(lines)-1], l.S, probe...)
			for _, i := range probe {
				r := got[i]
				bad := i >= tc.badFrom && i < tc.badTo
				switch {
				case bad && (r.ok || r.errno != "EIO"):
					t.Errorf("sector %d, which the attack concerns: ok=%v errno %q, want EIO", i, r.ok, r.errno)
				case !bad && !r.ok:
					t.Errorf("sector %d, which the attack does not concern: %s", i, r.errno)
				case !bad && i < written && r.hash != want(i):
					t.Errorf("sector %d reads other than its current data", i)
				case !bad && i >= written && r.hash != sha256.Sum256(make([]byte, l.S)):
					t.Errorf("never-written sector %d is not zero", i)
				}
			}
		})
	}

	// The whole provider put back: consistent in itself, refused by the witness that the
	// attaches above kept for f.img.
	if err := os.WriteFile(img, old, 0o600); err != nil {
		t.Fatal(err)
	}
	e.FailsCode(1, "older than its witness", "attach", "--passphrase-file", e.Pass, img)
}

// TestFreshnessAfterKill: the server is killed (SIGKILL) right after a flush that rewrote
// two sectors, and the old ciphertext of those sectors is put back into the provider
// file. The next attach, with the default witness, must make both sectors EIO, never
// their old data, while their neighbours read. Before a flush waited for the slot that
// completes its round (docs/format.md, "Journal"), recovery took the old records back.
func TestFreshnessAfterKill(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	e := newEnv(t, false)
	img := e.create(volume{name: "k.img", size: "16M"})
	l := e.dumpLayout(img)
	R := l.perGroup()
	version := func(i int64, v byte) []byte { return sectorVersion(i, l.S, v) }
	old := writeVersionA(t, e, img, "k.img", l.S, 2*R)

	rewritten := []int64{R + 5, R + 20}
	uri := e.Attach(img)
	pid := e.Attached("k.img").Pid
	for _, i := range rewritten {
		pythonNBD(t, version(i, 'B'), "pwrite", uri, fmt.Sprint(i*l.S)) // write and flush
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	e.waitGone(t, "k.img", pid)

	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range rewritten {
		at := l.dataAt(t, i)
		if _, err := f.WriteAt(old[at:at+l.S], at); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}

	uri = e.Attach(img)
	defer e.detach("k.img")
	probe := []int64{0, R, R + 5, R + 6, R + 20, 2*R - 1}
	got := readSectors(t, uri, l.S, probe...)
	for _, i := range probe {
		r := got[i]
		switch {
		case slices.Contains(rewritten, i):
			if r.ok || r.errno != "EIO" {
				t.Errorf("sector %d, flushed as B and its old ciphertext put back: ok=%v errno %q (old data: %v), want EIO",
					i, r.ok, r.errno, r.ok && r.hash == sha256.Sum256(version(i, 'A')))
			}
		case !r.ok || r.hash != sha256.Sum256(version(i, 'A')):
			t.Errorf("sector %d, untouched: ok=%v errno %q, or not its data", i, r.ok, r.errno)
		}
	}
}

// sectorVersion is version v (a letter) of sector i's content (sectorContent), S bytes.
func sectorVersion(i, s int64, v byte) []byte {
	b := sectorContent(i, s)
	b[0] = v
	return b
}

// writeVersionA writes version 'A' of sectors [0, n) of the volume name (provider img,
// S-byte sectors) through libnbd, detaches it, and returns the provider's image.
func writeVersionA(t *testing.T, e *env, img, name string, s, n int64) []byte {
	t.Helper()
	var all []byte
	for i := range n {
		all = append(all, sectorVersion(i, s, 'A')...)
	}
	pythonNBD(t, all, "pwrite", e.Attach(img), "0")
	e.detach(name)
	old, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	return old
}

package integration

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/internal/testtool"
)

// Scenario 3 (issue 6): tampering with the provider of a default-mode volume, found from
// docs/format.md. A changed byte in a data sector or in its record makes that sector an
// I/O error and nothing else: its neighbours (including sectors whose records share the
// metadata block) read fine and the server stays up.

// sectorContent is what the tests write to sector i: distinct per sector, so that a
// sector read from the wrong place cannot pass for another.
func sectorContent(i, s int64) []byte {
	b := make([]byte, s)
	for k := range b {
		b[k] = byte(i*131 + int64(k)*7 + int64(k>>8))
	}
	copy(b, fmt.Sprintf("sector %d of the tamper test", i))
	return b
}

// flipByte inverts one byte of a file in place.
func flipByte(t testing.TB, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatalf("read %s at %d: %v", path, off, err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatalf("write %s at %d: %v", path, off, err)
	}
}

func TestTamperSectors(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	for _, ss := range []int{512, 4096} {
		t.Run(fmt.Sprint(ss), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, false)
			// Format version 1: one sector per tampered record fails (version 2 fails the
			// whole metadata block: TestTamperSectorsV2).
			img := e.create(volume{name: "t.img", size: "16M", sector: ss, extra: []string{"--format", "1"}})
			l := e.dumpLayout(img)
			if !l.authenticated() {
				t.Fatalf("default mode %s has no records", l.mode)
			}
			R := l.perGroup()
			written := 2*R + 10 // three groups, the last one partly
			var all []byte
			for i := int64(0); i < written; i++ {
				all = append(all, sectorContent(i, l.S)...)
			}
			uri := e.Attach(img)
			pythonNBD(t, all, "pwrite", uri, "0")
			e.detach("t.img") // no cached metadata may hide the damage

			// Both in the second group: data of sector R+5, the record of sector R+20 (in the
			// metadata block that also holds the records of R+5 and of every neighbour).
			dataSec, recSec := R+5, R+20
			flipByte(t, img, l.dataAt(t, dataSec)+100)
			flipByte(t, img, l.recordAt(t, recSec)+30) // inside the Poly1305 tag

			uri = e.Attach(img)
			probe := []int64{0, dataSec - 1, dataSec, dataSec + 1, recSec - 1, recSec, recSec + 1, R - 1, R, 2 * R, written - 1, written}
			check := func(when string) {
				t.Helper()
				got := readSectors(t, uri, l.S, probe...)
				for _, i := range probe {
					r := got[i]
					switch {
					case i == dataSec || i == recSec:
						if r.ok || r.errno != "EIO" {
							t.Errorf("%s: tampered sector %d: ok=%v errno %q, want EIO", when, i, r.ok, r.errno)
						}
					case !r.ok:
						t.Errorf("%s: sector %d next to tampered ones: %s", when, i, r.errno)
					case i < written && r.hash != sha256.Sum256(sectorContent(i, l.S)):
						t.Errorf("%s: sector %d reads wrong data", when, i)
					case i >= written && r.hash != sha256.Sum256(make([]byte, l.S)):
						t.Errorf("%s: never-written sector %d is not zero", when, i)
					}
				}
			}
			check("first read")
			// The server is still up and answers a new connection the same way.
			if rec := e.Attached("t.img"); rec.Pid <= 0 {
				t.Fatalf("server record without a pid: %+v", rec)
			}
			check("second connection")
			log := e.serverLog("t.img")
			for _, i := range []int64{dataSec, recSec} {
				if !strings.Contains(log, "sector failed authentication") || !strings.Contains(log, fmt.Sprintf("sector=%d ", i)) {
					t.Errorf("server log does not name sector %d:\n%s", i, log)
				}
			}

			// A real client copying the whole export fails instead of copying garbage.
			if out, err := commandErr(time.Minute, "nbdcopy", uri, "null:"); err == nil {
				t.Errorf("nbdcopy of a volume with tampered sectors succeeded:\n%s", out)
			}

			// Writing a tampered sector anew makes it whole again.
			fresh := bytes.Repeat([]byte{0x5a}, int(l.S))
			pythonNBD(t, fresh, "pwrite", uri, fmt.Sprint(dataSec*l.S))
			if r := readSectors(t, uri, l.S, dataSec)[dataSec]; !r.ok || r.hash != sha256.Sum256(fresh) {
				t.Errorf("rewritten sector %d: ok=%v errno %q", dataSec, r.ok, r.errno)
			}
			e.detach("t.img")
		})
	}
}

// TestTamperSectorsV2: in format version 2 (the default) a flipped byte of a record, or a
// record put back from an older image, makes every sector of its metadata block an I/O
// error (the block no longer matches the hash tree), while the sectors of other groups
// read their data; the server log names the group.
func TestTamperSectorsV2(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	e := newEnv(t, false)
	img := e.create(volume{name: "t2.img", size: "16M"})
	l := e.dumpLayout(img)
	if l.V != 2 || !l.authenticated() {
		t.Fatalf("default volume: version %d, mode %s", l.V, l.mode)
	}
	R := l.perGroup()
	written := 3 * R
	var all []byte
	for i := int64(0); i < written; i++ {
		all = append(all, sectorContent(i, l.S)...)
	}
	uri := e.Attach(img)
	pythonNBD(t, all, "pwrite", uri, "0")
	e.detach("t2.img")
	flipByte(t, img, l.recordAt(t, R+20)+30)
	uri = e.Attach(img)
	probe := []int64{0, R - 1, R, R + 20, 2*R - 1, 2 * R, written - 1, written}
	got := readSectors(t, uri, l.S, probe...)
	for _, i := range probe {
		r := got[i]
		switch {
		case i >= R && i < 2*R:
			if r.ok || r.errno != "EIO" {
				t.Errorf("sector %d of the tampered group: ok=%v errno %q, want EIO", i, r.ok, r.errno)
			}
		case !r.ok:
			t.Errorf("sector %d of another group: %s", i, r.errno)
		case i < written && r.hash != sha256.Sum256(sectorContent(i, l.S)):
			t.Errorf("sector %d reads wrong data", i)
		case i >= written && r.hash != sha256.Sum256(make([]byte, l.S)):
			t.Errorf("never-written sector %d is not zero", i)
		}
	}
	if log := e.serverLog("t2.img"); !strings.Contains(log, "does not match the hash tree") || !strings.Contains(log, "group=1 ") {
		t.Errorf("server log does not name group 1:\n%s", log)
	}
	e.detach("t2.img")
}

// TestTamperHeader damages header copy A, copy B, or both (docs/format.md: A at 0, B at
// (P − P mod 4096) − 4096). One damaged copy: attach works from the other and warns. Both:
// attach fails with a clear message, changes nothing, and `eli restore` from the backup
// init wrote brings the volume back with its data.
func TestTamperHeader(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		damage []string // "A", "B"
	}{
		{"copy A", []string{"A"}},
		{"copy B", []string{"B"}},
		{"both copies", []string{"A", "B"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, false)
			backup := e.Path("h.backup")
			img := e.create(volume{name: "h.img", size: "16M", extra: []string{"--backup", backup}})
			data := bytes.Repeat([]byte("precious data. "), 70000) // about 1 MiB
			uri := e.Attach(img)
			pythonNBD(t, data, "pwrite", uri, "4096")
			e.detach("h.img")

			st, err := os.Stat(img)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range tc.damage {
				// Offset 200 is inside keyslot 0 (128..320): the checksum catches it.
				off := int64(200)
				if c == "B" {
					off += headerB(st.Size())
				}
				flipByte(t, img, off)
			}
			readBack := func() {
				t.Helper()
				uri := e.Attach(img)
				if got := pythonNBD(t, nil, "pread", uri, "4096", fmt.Sprint(len(data))); got != string(data) {
					t.Fatal("data read back differs from what was written")
				}
				e.detach("h.img")
			}

			if len(tc.damage) == 1 {
				r := e.Run("", "attach", "--passphrase-file", e.Pass, img)
				if r.Code != 0 {
					t.Fatalf("attach with one good header copy: %v", r)
				}
				if !strings.Contains(r.Stderr, "warning") || !strings.Contains(r.Stderr, "corrupt") {
					t.Fatalf("attach with a damaged header copy does not warn: %v", r)
				}
				e.detach("h.img")
				readBack()
				return
			}

			before := elitest.FileHash(t, img)
			r := e.Fails("corrupt", "attach", "--passphrase-file", e.Pass, img)
			if !strings.Contains(r.Stderr, "eli restore") {
				t.Errorf("the error does not point to eli restore: %v", r)
			}
			if elitest.FileHash(t, img) != before {
				t.Fatal("failed attach changed the provider")
			}
			e.OK("restore", backup, img)
			r = e.OK("attach", "--passphrase-file", e.Pass, img)
			if strings.Contains(r.Stderr, "warning") {
				t.Errorf("attach after restore still warns: %v", r)
			}
			e.detach("h.img")
			readBack()
		})
	}
}

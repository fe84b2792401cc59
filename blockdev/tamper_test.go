package blockdev

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/sector"
)

// countHandler counts log records whose message contains a substring.
type countHandler struct {
	substr string
	n      *atomic.Int64
}

func (h countHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.substr) {
		h.n.Add(1)
	}
	return nil
}
func (h countHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countHandler) WithGroup(string) slog.Handler      { return h }

const tamperSectors = 250

// tamperVolume writes a known pattern to every sector of a fresh volume (two volumes with
// the same keys but different volume IDs: a and b), closes them cleanly, and returns them.
func tamperVolumes(t *testing.T) (a, b *testVol, plain []byte) {
	t.Helper()
	a = newTestVol(t, sector.ModeXChaCha20Poly1305, 512, tamperSectors)
	b = newTestVol(t, sector.ModeXChaCha20Poly1305, 512, tamperSectors)
	otherID := testVolumeID
	otherID[0] ^= 0xff
	b.cfg.Codec = newCodec(t, sector.ModeXChaCha20Poly1305, 512, otherID)
	plain = make([]byte, tamperSectors*512)
	for i := range plain {
		plain[i] = byte(i/512) ^ byte(i)
	}
	for _, v := range []*testVol{a, b} {
		d := v.open(t)
		if err := d.WriteAt(plain, 0, 0); err != nil {
			t.Fatal(err)
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
	}
	return a, b, plain
}

// Each case changes the provider of volume a behind the device's back; the sectors it
// names must then fail to read with an error wrapping sector.ErrAuth and EIO, while every
// other sector still reads correctly.
func TestTamperDetected(t *testing.T) {
	t.Parallel()
	skipFormat2(t)
	const i, j = 7, 150 // two sectors in different groups
	cases := []struct {
		name   string
		victim []uint64
		tamper func(l Layout, raw, other []byte)
	}{
		{"ciphertext bit", []uint64{i}, func(l Layout, raw, _ []byte) {
			raw[l.DataPos(i)+100] ^= 0x04
		}},
		{"record nonce bit", []uint64{i}, func(l Layout, raw, _ []byte) {
			raw[recPos(l, i)+3] ^= 0x80
		}},
		{"record tag bit", []uint64{i}, func(l Layout, raw, _ []byte) {
			raw[recPos(l, i)+39] ^= 0x01
		}},
		{"records swapped", []uint64{i, j}, func(l Layout, raw, _ []byte) {
			ri, rj := bytes.Clone(rec(l, raw, i)), bytes.Clone(rec(l, raw, j))
			copy(rec(l, raw, i), rj)
			copy(rec(l, raw, j), ri)
		}},
		{"sector and record moved to another index", []uint64{i}, func(l Layout, raw, _ []byte) {
			copy(data(l, raw, i), data(l, raw, j))
			copy(rec(l, raw, i), rec(l, raw, j))
		}},
		{"sector and record from another volume", []uint64{i}, func(l Layout, raw, other []byte) {
			copy(data(l, raw, i), data(l, other, i))
			copy(rec(l, raw, i), rec(l, other, i))
		}},
		{"data sectors swapped", []uint64{i, i + 1}, func(l Layout, raw, _ []byte) {
			di, dj := bytes.Clone(data(l, raw, i)), bytes.Clone(data(l, raw, i+1))
			copy(data(l, raw, i), dj)
			copy(data(l, raw, i+1), di)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			a, b, plain := tamperVolumes(t)
			tc.tamper(a.l, a.mem.data, b.mem.data)
			var logged atomic.Int64
			a.cfg.Logger = slog.New(countHandler{"failed authentication", &logged})
			d := a.open(t)
			defer d.Close()
			bad := map[uint64]bool{}
			for _, v := range tc.victim {
				bad[v] = true
			}
			buf := make([]byte, 512)
			for k := uint64(0); k < tamperSectors; k++ {
				for range 2 { // the second read must not log again
					err := d.ReadAt(buf, int64(k)*512)
					want := plain[k*512 : (k+1)*512]
					if !bad[k] {
						if err != nil || !bytes.Equal(buf, want) {
							t.Fatalf("untouched sector %d: %v", k, err)
						}
						continue
					}
					if !errors.Is(err, sector.ErrAuth) || !errors.Is(err, syscall.EIO) {
						t.Fatalf("tampered sector %d: got %v, want an error wrapping ErrAuth and EIO", k, err)
					}
					if bytes.Equal(buf, want) {
						t.Fatalf("tampered sector %d: its plaintext was left in the buffer", k)
					}
				}
			}
			// A large read spanning the victims fails as a whole, naming the first one.
			all := make([]byte, len(plain)-100)
			err := d.ReadAt(all, 100)
			var se *SectorError
			if !errors.Is(err, sector.ErrAuth) || !errors.As(err, &se) {
				t.Fatalf("whole-volume read: %v", err)
			}
			if se.Sector != tc.victim[0] || se.Offset != max(100, int64(tc.victim[0])*512) {
				t.Fatalf("whole-volume read blames sector %d at offset %d, want %d", se.Sector, se.Offset, tc.victim[0])
			}
			// A read starting inside the victim reports its own start as the offset.
			err = d.ReadAt(buf[:100], int64(tc.victim[0])*512+7)
			if !errors.As(err, &se) || se.Offset != int64(tc.victim[0])*512+7 {
				t.Fatalf("partial read of a victim: %v", err)
			}
			if got := logged.Load(); got != int64(len(tc.victim)) {
				t.Fatalf("%d log lines for %d tampered sectors, want one each", got, len(tc.victim))
			}
			if got := d.Stats().AuthFailures; got < uint64(2*len(tc.victim)) {
				t.Fatalf("AuthFailures = %d", got)
			}
		})
	}
}

// TestTamperUndetectable documents what per-sector authentication cannot see (and what
// docs/threat-model.md must say): an attacker who can write the provider and has kept an
// older copy of it can put back an older (data, record) pair of the same sector, and the
// device returns that older plaintext without complaint. Zeroing a record is the special
// case of rolling the sector back to "never written": it reads as zeroes. Neither can
// produce plaintext that was never written to that sector of that volume.
func TestTamperUndetectable(t *testing.T) {
	t.Parallel()
	skipFormat2(t)
	const i = 42
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, tamperSectors)
	oldPlain := bytes.Repeat([]byte("old!"), 128)
	newPlain := bytes.Repeat([]byte("new!"), 128)
	d := v.open(t)
	if err := d.WriteAt(oldPlain, i*512, FUA); err != nil {
		t.Fatal(err)
	}
	oldData := bytes.Clone(data(v.l, v.mem.data, i))
	oldRec := bytes.Clone(rec(v.l, v.mem.data, i))
	if err := d.WriteAt(newPlain, i*512, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	// Replay: the old pair, put back in place.
	copy(data(v.l, v.mem.data, i), oldData)
	copy(rec(v.l, v.mem.data, i), oldRec)
	d = v.open(t)
	buf := make([]byte, 512)
	if err := d.ReadAt(buf, i*512); err != nil {
		t.Fatalf("replayed sector: %v", err)
	}
	if !bytes.Equal(buf, oldPlain) {
		t.Fatal("replayed sector did not read as its old value")
	}
	d.Close()

	// Replaying only half of the pair is detected.
	copy(data(v.l, v.mem.data, i), oldData)
	copy(rec(v.l, v.mem.data, i+1), oldRec)
	d = v.open(t)
	if err := d.ReadAt(buf, (i+1)*512); !errors.Is(err, sector.ErrAuth) {
		t.Fatalf("old record at the wrong index: %v", err)
	}
	d.Close()

	// Rollback to "never written".
	clear(rec(v.l, v.mem.data, i))
	d = v.open(t)
	defer d.Close()
	if err := d.ReadAt(buf, i*512); err != nil || !bytes.Equal(buf, make([]byte, 512)) {
		t.Fatalf("zeroed record: %v, want zeroes", err)
	}
}

// TestTamperJournal: a journal that does not open (tampered, or torn) is never replayed;
// recovery then changes nothing, so a sector caught mid-commit reads as an error, never as
// data it did not hold.
func TestTamperJournal(t *testing.T) {
	t.Parallel()
	skipFormat2(t)
	v := newTestVol(t, sector.ModeXChaCha20Poly1305, 512, tamperSectors)
	rec0 := newRecorder(v.mem.data)
	d, err := Open(rec0, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	oldPlain := bytes.Repeat([]byte{0x11}, 512)
	newPlain := bytes.Repeat([]byte{0x22}, 512)
	if err := d.WriteAt(oldPlain, 0, FUA); err != nil {
		t.Fatal(err)
	}
	before := rec0.numEvents()
	if err := d.WriteAt(newPlain, 0, FUA); err != nil {
		t.Fatal(err)
	}
	d.Close()
	// Events of the second commit: journal write, sync, data, metadata block, sync. Keep
	// the journal and the new data, lose the metadata block: recovery must roll forward.
	img := bytes.Clone(rec0.base)
	for _, e := range rec0.events[:before+3] {
		apply(img, e, e.off, e.off+e.size())
	}
	d2, err := Open(&memProvider{data: bytes.Clone(img)}, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	if err := d2.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, newPlain) {
		t.Fatalf("intact journal: %v, rolled forward: %v (recovery %+v)", err, bytes.Equal(buf, newPlain), d2.Recovery())
	}
	d2.Close()

	img[v.l.JournalOffset()+journalHeaderLen+5] ^= 1
	d3, err := Open(&memProvider{data: img}, v.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d3.Close()
	if r := d3.Recovery(); r.Journal != "torn" {
		t.Fatalf("tampered journal: recovery %+v, want torn", r)
	}
	if err := d3.ReadAt(buf, 0); !errors.Is(err, sector.ErrAuth) {
		t.Fatalf("sector left mid-commit without its journal: %v, want ErrAuth", err)
	}
}

func recPos(l Layout, i uint64) int64 {
	g, j := l.GroupOf(i)
	return l.BlockPos(g) + int64(j)*layout.RecordSize
}

func rec(l Layout, raw []byte, i uint64) []byte {
	p := recPos(l, i)
	return raw[p : p+layout.RecordSize]
}

func data(l Layout, raw []byte, i uint64) []byte {
	p := l.DataPos(i)
	return raw[p : p+int64(l.SectorSize)]
}

// TestMetadataBlockUnusedBytes: the bytes of a metadata block that hold no record (its
// tail after the last record, and in the last group the records of positions past the
// last sector) are ignored on read in version 1, and kept as read when a commit writes
// the block back; in version 2 they are part of the block's digest, so one changed byte
// there fails every sector of the group (docs/format.md, "Data area, authenticated
// modes").
func TestMetadataBlockUnusedBytes(t *testing.T) {
	t.Parallel()
	for _, version := range []uint32{0, layout.Version2} {
		for _, where := range []string{"tail", "past the last sector"} {
			t.Run(fmt.Sprintf("version=%d/%s", max(version, 1), where), func(t *testing.T) {
				t.Parallel()
				v := newTestVolVersion(t, version, sector.ModeXChaCha20Poly1305, 512, tamperSectors)
				l := v.l
				r := uint64(l.RecordsPerGroup())
				if tamperSectors%r == 0 || l.MetaBlockSize()%layout.RecordSize == 0 {
					t.Fatalf("%d sectors of %d records per group leave no unused record or tail", tamperSectors, r)
				}
				plain := bytes.Repeat([]byte{0x3c}, tamperSectors*512)
				d := v.open(t)
				if err := d.WriteAt(plain, 0, 0); err != nil {
					t.Fatal(err)
				}
				if err := d.Close(); err != nil {
					t.Fatal(err)
				}
				g := uint64(1) // a full group: its tail
				off := l.BlockPos(g) + int64(r)*layout.RecordSize + 5
				if where != "tail" {
					g = tamperSectors / r // the last group: a record slot past the last sector
					off = recPos(l, tamperSectors) + 7
				}
				v.mem.data[off] ^= 0x20
				changed := v.mem.data[off]
				d = v.open(t)
				defer d.Close()
				buf := make([]byte, 512)
				for k := uint64(0); k < tamperSectors; k++ {
					err := d.ReadAt(buf, int64(k)*512)
					if l.Tree() && k/r == g {
						if !errors.Is(err, ErrFreshness) {
							t.Fatalf("version 2, sector %d of the changed block's group: %v, want ErrFreshness", k, err)
						}
						continue
					}
					if err != nil || !bytes.Equal(buf, plain[k*512:(k+1)*512]) {
						t.Fatalf("sector %d: %v", k, err)
					}
				}
				if l.Tree() {
					return
				}
				// Version 1 writes the block back with the changed byte as it read it.
				if err := d.WriteAt(buf, int64(g*r)*512, FUA); err != nil {
					t.Fatal(err)
				}
				if got := v.mem.snapshot()[off]; got != changed {
					t.Fatalf("after a commit to the group, the unused byte is %#x, want the %#x it held", got, changed)
				}
			})
		}
	}
}

package blockdev

import (
	"bytes"
	"crypto/aes"
	"crypto/sha256"
	"encoding/binary"
	"testing"
	"time"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/sector"

	"golang.org/x/crypto/chacha20poly1305"
	"golang.org/x/crypto/xts"
)

// Golden volumes caught halfway through a re-encryption (docs/format.md,
// "Re-encryption"), built from fixed keys and nonces like the other golden volumes:
//
//   - golden-reencrypting-v2-…: the version 2 golden workload under the first data key,
//     then a re-encryption to a second one, its sweep stopped after sector 150 and two
//     client writes (one below the cursor, one above it) made since, and the device
//     closed: sectors below the cursor, and the two written, are under the new key, the
//     rest under the old one, and the journal under the new journal key;
//   - golden-reencrypting-aes-xts-…: an aes-xts volume whose sweep was cut inside a
//     window: the hotzone slot for the window is durable and only the first half of the
//     window was rewritten.
//
// goldenIndependentRead decrypts both from the raw bytes and the keys alone, with
// x/crypto, following the format's text: which key sealed which sector is decided as
// docs/format.md says, never by blockdev's code.

var (
	goldenDataKey2    = seqBytes(0x80, 32)
	goldenJournalKey2 = seqBytes(0xa0, 32)
	goldenXTSKey      = seqBytes(0x10, 64)
	goldenXTSKey2     = seqBytes(0x50, 64)
)

const (
	goldenReencCursor = 150
	goldenReencV2     = "golden-reencrypting-v2-xchacha20-poly1305-512.img.gz"
	goldenReencXTS    = "golden-reencrypting-aes-xts-512.img.gz"
)

// writeGoldenReencrypting builds the version 2 image and returns it with its plaintext.
func writeGoldenReencrypting(t testing.TB) (img, plain []byte) {
	rec, _, model, _ := writeGolden(t, layout.Version2)
	l := goldenLayout(t, layout.Version2)
	a, _ := chacha20poly1305.NewX(goldenDataKey)
	a2, _ := chacha20poly1305.NewX(goldenDataKey2)
	mem := &memProvider{data: bytes.Clone(rec.cur)}
	d, err := Open(mem, Config{
		Layout: l, Codec: &goldenCodec{aead: a, count: 1 << 32}, JournalKey: goldenJournalKey,
		CommitInterval: time.Hour, MaxBatchBytes: 1 << 30, Workers: -1,
		rand: &detRand{state: sha256.Sum256([]byte("eli-golden-reencrypt"))},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.StartReencrypt(&goldenCodec{aead: a2, count: 1 << 33}, goldenJournalKey2, 1); err != nil {
		t.Fatal(err)
	}
	if st, err := d.Sweep(goldenReencCursor); err != nil || st.Cursor != goldenReencCursor {
		t.Fatalf("sweep: %+v, %v", st, err)
	}
	for _, w := range []struct {
		off int64
		b   []byte
	}{{10 * 512, bytes.Repeat([]byte("new-key below "), 37)[:512]}, {300 * 512, bytes.Repeat([]byte("new-key above "), 37)[:512]}} {
		if err := d.WriteAt(w.b, w.off, 0); err != nil {
			t.Fatal(err)
		}
		copy(model[w.off:], w.b)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	return mem.data, model
}

// writeGoldenReencryptingXTS builds the aes-xts image and returns it with its plaintext.
func writeGoldenReencryptingXTS(t testing.TB) (img, plain []byte) {
	l, err := layout.Plan(goldenProviderSize, 512, sector.ModeAESXTS256, 0)
	if err != nil {
		t.Fatal(err)
	}
	codec := func(k []byte) sector.Codec {
		c, err := sector.New(sector.Params{Mode: sector.ModeAESXTS256, SectorSize: 512, Key: k})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	rec := newRecorder(make([]byte, goldenProviderSize))
	d, err := Open(rec, Config{Layout: l, Codec: codec(goldenXTSKey), Workers: -1})
	if err != nil {
		t.Fatal(err)
	}
	// Sectors 0-169 written; the others hold zeroes, which decrypt to noise.
	written := make([]byte, 170*512)
	for i := range written {
		written[i] = byte(i/512) ^ byte(i*7)
	}
	if err := d.WriteAt(written, 0, FUA); err != nil {
		t.Fatal(err)
	}
	plain = make([]byte, d.Size())
	if err := d.ReadAt(plain, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.StartReencrypt(codec(goldenXTSKey2), nil, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Sweep(100); err != nil {
		t.Fatal(err)
	}
	// The next window, [100, 160): its slot and sync land, then half of its rewrite.
	start := rec.numEvents()
	if _, err := d.Sweep(60); err != nil {
		t.Fatal(err)
	}
	img = bytes.Clone(rec.base)
	for k, e := range rec.events {
		if k < start+2 || e.kind != evWrite {
			if e.kind != evSync {
				apply(img, e, e.off, e.off+e.size())
			}
			continue
		}
		if e.off >= l.DataOffset { // the window's rewrite: its first 30 sectors
			apply(img, e, e.off, e.off+30*512)
		}
		break
	}
	return img, plain
}

// goldenIndependentRead decrypts every sector of img from the format's text and the keys:
// dataKeys are the current and the previous key.
func goldenIndependentRead(t *testing.T, img []byte, l Layout, cur, prev []byte, epoch uint64) []byte {
	s := l.SectorSize
	out := make([]byte, l.Size())
	if l.Authenticated() {
		// Authenticated: a sector opens under the key that sealed it, and only that one.
		var aeads []interface {
			Open(dst, nonce, ciphertext, ad []byte) ([]byte, error)
		}
		for _, k := range [][]byte{cur, prev} {
			a, err := chacha20poly1305.NewX(k)
			if err != nil {
				t.Fatal(err)
			}
			aeads = append(aeads, a)
		}
		for i := range l.Sectors {
			g, j := l.GroupOf(i)
			recOff := l.BlockPos(g) + 40*int64(j)
			rec := img[recOff : recOff+40]
			if bytes.Equal(rec, make([]byte, 40)) {
				continue // never written: zeroes
			}
			data := img[l.DataPos(i) : l.DataPos(i)+int64(s)]
			var opened bool
			for _, a := range aeads {
				if p, err := a.Open(nil, rec[:24], append(bytes.Clone(data), rec[24:]...), goldenAD(i)); err == nil {
					copy(out[int(i)*s:], p)
					opened = true
					break
				}
			}
			if !opened {
				t.Fatalf("sector %d opens under neither key", i)
			}
		}
		return out
	}
	// Length-preserving: the newest hotzone slot of the epoch places the window.
	var lo, hi, seq uint64
	var sums []byte
	for k := range 2 {
		slot := img[layout.HotzoneOffset+k*layout.HotzoneLen/2:][:layout.HotzoneLen/2]
		le := binary.LittleEndian
		if string(slot[:8]) != "ELIHOTZ1" || le.Uint64(slot[16:]) != epoch {
			continue
		}
		a, b := le.Uint64(slot[24:]), le.Uint64(slot[32:])
		n := 48 + 16*int(b-a)
		if sum := sha256.Sum256(slot[:n]); !bytes.Equal(sum[:], slot[n:n+32]) {
			continue
		}
		if q := le.Uint64(slot[8:]); q > seq {
			seq, lo, hi, sums = q, a, b, slot[48:n]
		}
	}
	if seq == 0 {
		t.Fatal("no hotzone slot of the epoch")
	}
	ciphers := map[bool]*xts.Cipher{}
	for isCur, k := range map[bool][]byte{true: cur, false: prev} {
		c, err := xts.NewCipher(aes.NewCipher, k)
		if err != nil {
			t.Fatal(err)
		}
		ciphers[isCur] = c
	}
	for i := range l.Sectors {
		data := img[l.DataPos(i) : l.DataPos(i)+int64(s)]
		isCur := i < lo
		if i >= lo && i < hi {
			want := sums[16*(i-lo) : 16*(i-lo+1)]
			h := sha256.Sum256(data[:64])
			isCur = bytes.Equal(want, make([]byte, 16)) || !bytes.Equal(h[:16], want)
		}
		ciphers[isCur].Decrypt(out[int(i)*s:int(i+1)*s], data, i)
	}
	return out
}

func TestGoldenReencrypting(t *testing.T) {
	t.Parallel()
	v2, v2plain := writeGoldenReencrypting(t)
	xt, xtplain := writeGoldenReencryptingXTS(t)
	if *updateGolden {
		writeGoldenFile(t, goldenReencV2, v2)
		writeGoldenFile(t, goldenReencXTS, xt)
	}
	lv2 := goldenLayout(t, layout.Version2)
	lx, err := layout.Plan(goldenProviderSize, 512, sector.ModeAESXTS256, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range []struct {
		name           string
		built, plain   []byte
		l              Layout
		size           int64
		cur, prev, jrn []byte
	}{
		{goldenReencV2, v2, v2plain, lv2, goldenProviderSize2, goldenDataKey2, goldenDataKey, goldenJournalKey2},
		{goldenReencXTS, xt, xtplain, lx, goldenProviderSize, goldenXTSKey2, goldenXTSKey, nil},
	} {
		t.Run(g.name, func(t *testing.T) {
			img := readGoldenSize(t, g.name, g.size)
			if !bytes.Equal(img, g.built) {
				t.Fatalf("building the image again gives other bytes: the format changed (if deliberately, go test -run Golden ./blockdev/ -update)")
			}
			if got := goldenIndependentRead(t, img, g.l, g.cur, g.prev, 1); !bytes.Equal(got, g.plain) {
				t.Fatal("an independent reader following docs/format.md reads other plaintext")
			}
			// The device, with both keys, reads it too, read-only and writable, and
			// finishes the re-encryption.
			codec := func(k []byte) sector.Codec {
				c, err := sector.New(sector.Params{Mode: g.l.Mode, SectorSize: 512, Key: k, VolumeID: goldenVolumeID})
				if err != nil {
					t.Fatal(err)
				}
				return c
			}
			for _, ro := range []bool{true, false} {
				mem := &memProvider{data: bytes.Clone(img)}
				d, err := Open(mem, Config{Layout: g.l, Codec: codec(g.cur), JournalKey: g.jrn, ReadOnly: ro,
					Reencrypt: &Reencrypt{Prev: codec(g.prev), PrevJournalKey: goldenJournalKey, Epoch: 1}})
				if err != nil {
					t.Fatal(err)
				}
				got := make([]byte, d.Size())
				if err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, g.plain) {
					t.Fatalf("read-only %v: %v, equal %v", ro, err, bytes.Equal(got, g.plain))
				}
				if !ro {
					if err := NewSweeper(d, SweeperConfig{}).Run(t.Context()); err != nil {
						t.Fatal(err)
					}
					if err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, g.plain) {
						t.Fatalf("after the sweep: %v", err)
					}
				}
				if err := d.Close(); err != nil {
					t.Fatal(err)
				}
				if ro && !bytes.Equal(mem.data, img) {
					t.Fatal("a read-only attach wrote to the provider")
				}
			}
		})
	}
}

// readGoldenSize is readGolden for an image of size bytes.
func readGoldenSize(t *testing.T, name string, size int64) []byte {
	for _, f := range goldenFormats {
		if f.size == size {
			return readGolden(t, name, f.version)
		}
	}
	t.Fatalf("no golden size %d", size)
	return nil
}

package reencrypt_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/reencrypt"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
)

var pass = keys.Credentials{Passphrase: []byte("test")} // elitest.Volume's

// newVolume makes a volume of mode on a file, fills it with random data (one run of
// sectors trimmed in authenticated modes) and returns the provider and the data.
func newVolume(t *testing.T, version uint32, mode sector.Mode, size int64) (*provider.File, []byte) {
	t.Helper()
	path, _, mk := elitest.VolumeVersion(t, t.TempDir(), size, mode, version)
	mk.Wipe()
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	d, k := openDevice(t, p)
	defer k.Wipe()
	data := make([]byte, d.Size())
	rng := rand.New(rand.NewPCG(uint64(mode), 1))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	if err := d.WriteAt(data, 0, 0); err != nil {
		t.Fatal(err)
	}
	if mode.Authenticated() {
		if err := d.Trim(40960, 81920, 0); err != nil {
			t.Fatal(err)
		}
		clear(data[40960 : 40960+81920])
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	return p, data
}

// openDevice opens p with the keys its header names.
func openDevice(t *testing.T, p provider.Provider) (*blockdev.Device, *reencrypt.Keys) {
	t.Helper()
	h, mk := unlock(t, p)
	defer mk.Wipe()
	k, err := reencrypt.DeviceKeys(h, mk)
	if err != nil {
		t.Fatal(err)
	}
	cfg := blockdev.Config{Layout: h.Layout}
	k.Apply(&cfg)
	d, err := blockdev.Open(p, cfg)
	if err != nil {
		k.Wipe()
		t.Fatal(err)
	}
	return d, k
}

func unlock(t *testing.T, p provider.Provider) (*keys.Header, *keys.MasterKey) {
	t.Helper()
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	mk, _, err := h.Unlock(pass, keys.AnySlot)
	if err != nil {
		t.Fatal(err)
	}
	return h, mk
}

func readAll(t *testing.T, p provider.Provider) []byte {
	t.Helper()
	d, k := openDevice(t, p)
	defer k.Wipe()
	got := make([]byte, d.Size())
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	return got
}

// TestRun re-encrypts detached volumes, is stopped halfway (the volume then attaches
// through package volume with both keys and reads right), resumes, and ends with the
// data intact under a new master key that no keyslot shares with the old one.
func TestRun(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		version  uint32
		from, to sector.Mode
	}{
		{"xchacha20-poly1305-v2", layout.Version2, sector.ModeXChaCha20Poly1305, 0},
		{"xchacha20-poly1305-v1", layout.Version1, sector.ModeXChaCha20Poly1305, 0},
		{"aes128-xts-to-aes-xts", layout.Version1, sector.ModeAESXTS128, sector.ModeAESXTS256},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, data := newVolume(t, tc.version, tc.from, 24<<20)
			_, mk0 := unlock(t, p)
			defer mk0.Wipe()
			ctx, cancel := context.WithCancel(context.Background())
			steps := 0
			opts := reencrypt.Options{
				Header: keys.ReencryptOptions{Mode: tc.to, Slots: map[int]keys.Credentials{0: pass}},
				Sweep: blockdev.SweeperConfig{StepBytes: 1 << 20, OnProgress: func(blockdev.ReencryptStatus) {
					if steps++; steps == 5 {
						cancel()
					}
				}},
			}
			res, err := reencrypt.Run(ctx, p, mk0, opts)
			if !errors.Is(err, context.Canceled) || res.Resumed {
				t.Fatalf("stopped run: %+v, %v", res, err)
			}
			h, mk := unlock(t, p)
			r := h.Reencryption()
			if !r.Active || r.Cursor == 0 || r.Epoch != 1 {
				t.Fatalf("after the stop the header says %+v", r)
			}
			// A second re-encryption is refused while this one is under way.
			if _, err := keys.BeginReencrypt(p, mk, opts.Header); !errors.Is(err, keys.ErrReencrypting) {
				t.Fatalf("a second re-encryption: %v", err)
			}
			// Attached halfway (package volume), every sector reads right.
			v, err := volume.Open(p, mk, volume.Options{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(data))
			if err := v.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("attached halfway: %v, equal %v", err, bytes.Equal(got, data))
			}
			v.Close()
			opts.Sweep.OnProgress = nil
			res, err = reencrypt.Run(context.Background(), p, mk, opts)
			mk.Wipe()
			if err != nil || !res.Resumed || res.Epoch != 1 || res.Moved == 0 {
				t.Fatalf("resumed run: %+v, %v", res, err)
			}
			if !bytes.Equal(readAll(t, p), data) {
				t.Fatal("the data changed")
			}
			h, mk = unlock(t, p)
			defer mk.Wipe()
			if r := h.Reencryption(); r.Active || r.Epoch != 1 || bytes.Equal(mk.Bytes(), mk0.Bytes()) {
				t.Fatalf("after the end: %+v, same key %v", r, bytes.Equal(mk.Bytes(), mk0.Bytes()))
			}
			if tc.to != 0 && h.Mode != tc.to {
				t.Fatalf("mode %s", h.Mode)
			}
		})
	}
}

func TestCheckRefuses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		from, to sector.Mode
	}{
		{sector.ModeXChaCha20Poly1305, sector.ModeAESXTS256},
		{sector.ModeAESXTS256, sector.ModeXChaCha20Poly1305},
		{sector.ModeNone, 0},
	} {
		p, _ := newVolume(t, layout.Version1, tc.from, 8<<20)
		h, mk := unlock(t, p)
		if err := reencrypt.Check(h, tc.to); !errors.Is(err, keys.ErrModeChange) {
			t.Errorf("%s to %s: %v", tc.from, tc.to, err)
		}
		if _, err := reencrypt.Run(context.Background(), p, mk, reencrypt.Options{Header: keys.ReencryptOptions{Mode: tc.to, Slots: map[int]keys.Credentials{0: pass}}}); !errors.Is(err, keys.ErrModeChange) {
			t.Errorf("run %s to %s: %v", tc.from, tc.to, err)
		}
		mk.Wipe()
		if h2, _ := keys.Read(p); h2.Reencryption().Epoch != 0 {
			t.Errorf("%s to %s: the header changed", tc.from, tc.to)
		}
	}
}

// TestResizeHalfway: a volume grown while a re-encryption is under way (as eli resize
// does: the new area punched, then the header) keeps its re-encryption, and the resumed
// sweep goes on to the new end.
func TestResizeHalfway(t *testing.T) {
	t.Parallel()
	for _, mode := range []sector.Mode{sector.ModeXChaCha20Poly1305, sector.ModeAESXTS256} {
		version := uint32(layout.Version1)
		if mode.Authenticated() {
			version = layout.Version2
		}
		p, data := newVolume(t, version, mode, 16<<20)
		_, mk0 := unlock(t, p)
		ctx, cancel := context.WithCancel(context.Background())
		opts := reencrypt.Options{
			Header: keys.ReencryptOptions{Slots: map[int]keys.Credentials{0: pass}},
			Sweep:  blockdev.SweeperConfig{StepBytes: 1 << 20, OnProgress: func(blockdev.ReencryptStatus) { cancel() }},
		}
		if _, err := reencrypt.Run(ctx, p, mk0, opts); !errors.Is(err, context.Canceled) {
			t.Fatal(err)
		}
		mk0.Wipe()
		h, mk := unlock(t, p)
		old := h.Layout
		if err := p.Extend(32 << 20); err != nil {
			t.Fatal(err)
		}
		l, err := layout.PlanVersion(old.Version, p.Size(), old.SectorSize, old.Mode, old.JournalLen)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Punch(old.End(), layout.DataLimit(p.Size())-old.End()); err != nil {
			t.Fatal(err)
		}
		if err := keys.Resize(p, mk, l.Sectors); err != nil {
			t.Fatal(err)
		}
		if r := mustHeader(t, p).Reencryption(); !r.Active {
			t.Fatalf("%s: resize ended the re-encryption: %+v", mode, r)
		}
		opts.Sweep.OnProgress = nil
		res, err := reencrypt.Run(context.Background(), p, mk, opts)
		mk.Wipe()
		if err != nil || !res.Resumed {
			t.Fatalf("%s: %+v, %v", mode, res, err)
		}
		got := readAll(t, p)
		if int64(len(got)) != l.Size() || !bytes.Equal(got[:len(data)], data) {
			t.Fatalf("%s: after resize and the end, %d bytes, the old part equal %v", mode, len(got), bytes.Equal(got[:len(data)], data))
		}
		if mode.Authenticated() && !bytes.Equal(got[len(data):], make([]byte, len(got)-len(data))) {
			t.Fatalf("%s: the grown part does not read as zeroes", mode)
		}
	}
}

func mustHeader(t *testing.T, p provider.Provider) *keys.Header {
	t.Helper()
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

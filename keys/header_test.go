package keys

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

func TestCreateReadRoundTrip(t *testing.T) {
	t.Parallel()
	layouts := []struct {
		name string
		size int64
		l    Layout
	}{
		{"aead 4k", testSize, testLayout()},
		{"aead 512", testSize, Layout{Mode: sector.ModeXChaCha20Poly1305, SectorSize: 512, JournalLen: 2 << 20, DataOffset: 65536 + 2<<20, Sectors: 1}},
		{"aead 64k", 16 << 20, Layout{Mode: sector.ModeXChaCha20Poly1305, SectorSize: 65536, JournalLen: 65536, DataOffset: 131072, Sectors: 100}},
		{"xts", testSize, Layout{Mode: sector.ModeAESXTS256, SectorSize: 4096, DataOffset: 65536, Sectors: (testSize - 2*65536) / 4096}},
		{"none, odd size", testSize + 777, Layout{Mode: sector.ModeNone, SectorSize: 512, DataOffset: 65536, Sectors: 1000}},
	}
	for _, tc := range layouts {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newMem(tc.size)
			mk, err := Create(p, tc.l, pass("secret"), tiny)
			if err != nil {
				t.Fatalf("Create: %v", err)
			}
			defer mk.Wipe()
			h := mustRead(t, p)
			if h.Layout != tc.l {
				t.Errorf("layout = %+v, want %+v", h.Layout, tc.l)
			}
			if h.VolumeID != mk.VolumeID() || h.Sequence != 1 || h.ProviderSize != tc.size || h.Version != 1 {
				t.Errorf("header = id %x seq %d size %d version %d", h.VolumeID, h.Sequence, h.ProviderSize, h.Version)
			}
			if h.Copy != CopyA || h.Offset != 0 || h.Warning != nil {
				t.Errorf("copy %v offset %d warning %v, want A, 0, nil", h.Copy, h.Offset, h.Warning)
			}
			if h.ActiveSlots() != 1 || !h.Slots[0].Active || h.Slots[0].Uses != UsesPassphrase || h.Slots[0].KDF != tiny {
				t.Errorf("slots = %+v", h.Slots)
			}
			a := p.bytesAt(0, HeaderSize)
			b := p.bytesAt(copyB(p), HeaderSize)
			if !bytes.Equal(a, b) || !bytes.Equal(a, h.Backup()) {
				t.Error("copies A and B (and the backup) differ")
			}
			if !allZero(p.bytesAt(HeaderSize, layout.HeaderRegionLen-HeaderSize)) {
				t.Error("reserved area is not zero")
			}
			if bytes.Contains(a, mk.Bytes()) {
				t.Error("the master key is in the header in the clear")
			}
			mustUnlock(t, p, pass("secret"), 0, mk)
		})
	}
}

func TestOnRealFile(t *testing.T) {
	t.Parallel()
	path := t.TempDir() + "/vol"
	if err := writeFile(path, testSize); err != nil {
		t.Fatal(err)
	}
	f, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mk, err := Create(f, testLayout(), pass("file"), tiny)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	defer mk.Wipe()
	if _, err := SetKey(f, mk, AnySlot, pass("other"), tiny); err != nil {
		t.Fatalf("SetKey: %v", err)
	}
	g, err := provider.Open(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	h, err := Read(g)
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	got, slot, err := h.Unlock(pass("other"), AnySlot)
	if err != nil || slot != 1 {
		t.Fatalf("Unlock = slot %d, %v", slot, err)
	}
	defer got.Wipe()
	if !bytes.Equal(got.Bytes(), mk.Bytes()) {
		t.Error("master key differs after a round trip through a file")
	}
}

func TestReadPicksGoodCopy(t *testing.T) {
	t.Parallel()
	// Each case damages the copies of a volume whose slot 0 takes "pw0"; an older copy is
	// the volume before SetKey added slot 1 ("pw1").
	cases := []struct {
		name     string
		damage   func(p *memProvider, old []byte)
		want     Copy
		warnKind error
		warnText string
		pw1      bool // the winning copy has slot 1
	}{
		{"both good", func(*memProvider, []byte) {}, CopyA, nil, "", true},
		{"A garbage", func(p *memProvider, _ []byte) { p.put(100, []byte("garbage")) }, CopyB, ErrCorrupt, "eli header copy at offset 0 is corrupt (checksum mismatch)", true},
		{"B garbage", func(p *memProvider, _ []byte) { p.put(copyB(p)+2000, []byte{1}) }, CopyA, ErrCorrupt, "is corrupt (checksum mismatch)", true},
		{"A zeroed", func(p *memProvider, _ []byte) { p.put(0, make([]byte, HeaderSize)) }, CopyB, ErrNotELI, "no eli header at offset 0", true},
		{"B zeroed", func(p *memProvider, _ []byte) { p.put(copyB(p), make([]byte, HeaderSize)) }, CopyA, ErrNotELI, "no eli header at offset", true},
		{"A older", func(p *memProvider, old []byte) { p.put(0, old) }, CopyB, ErrStale, "eli header copy at offset 0 is older than copy B (sequence 1 < 2)", true},
		{"B older", func(p *memProvider, old []byte) { p.put(copyB(p), old) }, CopyA, ErrStale, "older than copy A", true},
		{"B older, A garbage", func(p *memProvider, old []byte) { p.put(copyB(p), old); p.put(300, []byte{9}) }, CopyB, ErrCorrupt, "corrupt", false},
		{"same sequence, different", func(p *memProvider, old []byte) {
			var r [HeaderSize]byte
			copy(r[:], old)
			setSequence(&r, 2)
			rewrite(p, copyB(p), r[:])
		}, CopyA, ErrCorrupt, "differs from copy A at the same sequence number 2", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, mk := newVolume(t)
			old := p.bytesAt(0, HeaderSize)
			if _, err := SetKey(p, mk, AnySlot, pass("pw1"), tiny); err != nil {
				t.Fatal(err)
			}
			tc.damage(p, old)
			h := mustRead(t, p)
			if h.Copy != tc.want {
				t.Errorf("used copy %v, want %v", h.Copy, tc.want)
			}
			if tc.warnKind == nil {
				if h.Warning != nil {
					t.Errorf("warning %v, want none", h.Warning)
				}
			} else if !errors.Is(h.Warning, tc.warnKind) || !strings.Contains(h.Warning.Error(), tc.warnText) {
				t.Errorf("warning %q, want %v containing %q", h.Warning, tc.warnKind, tc.warnText)
			}
			mustUnlock(t, p, pass("pw0"), 0, mk)
			if _, err := unlock(p, pass("pw1"), AnySlot); (err == nil) != tc.pw1 {
				t.Errorf("unlock with pw1: %v, want success %v", err, tc.pw1)
			}
			// The next update rewrites both copies: afterwards they agree.
			if _, err := SetKey(p, mk, 5, pass("pw5"), tiny); err != nil {
				t.Fatal(err)
			}
			h = mustRead(t, p)
			if h.Warning != nil || !bytes.Equal(p.bytesAt(0, HeaderSize), p.bytesAt(copyB(p), HeaderSize)) {
				t.Errorf("after an update: warning %v, copies equal %v", h.Warning,
					bytes.Equal(p.bytesAt(0, HeaderSize), p.bytesAt(copyB(p), HeaderSize)))
			}
		})
	}
}

// A crash at any write of an update leaves a header that reads and unlocks with the
// keys of the old or of the new state.
func TestTornUpdate(t *testing.T) {
	t.Parallel()
	// After each op, "pw2" (slot 2) and "new" open the volume or not, as newState says.
	ops := []struct {
		name     string
		op       func(p provider.Provider, mk *MasterKey) error
		newState [2]bool
	}{
		{"setkey", func(p provider.Provider, mk *MasterKey) error {
			_, err := SetKey(p, mk, 1, pass("new"), tiny)
			return err
		}, [2]bool{true, true}},
		{"delkey", func(p provider.Provider, _ *MasterKey) error { return DelKey(p, 2, false) }, [2]bool{false, false}},
		{"replace", func(p provider.Provider, mk *MasterKey) error {
			_, err := SetKey(p, mk, 2, pass("new"), tiny)
			return err
		}, [2]bool{false, true}},
	}
	oldState := [2]bool{true, false}
	for _, op := range ops {
		for writes := 0; writes < 2; writes++ {
			for _, torn := range []int{0, 1, 100, 2048, 4095} {
				t.Run(fmt.Sprintf("%s/write%d/torn%d", op.name, writes, torn), func(t *testing.T) {
					t.Parallel()
					base, mk := newVolume(t)
					if _, err := SetKey(base, mk, 2, pass("pw2"), tiny); err != nil {
						t.Fatal(err)
					}
					c := &crashProvider{memProvider: base, writes: writes, torn: torn}
					if err := op.op(c, mk); !errors.Is(err, errCrashed) {
						t.Fatalf("op = %v, want the simulated crash", err)
					}
					h := mustRead(t, base)
					// A tear that reaches the sequence number leaves a copy that fails its
					// checksum (or, torn at the very end, an older one): Read says so. The
					// one exception: torn one byte short, when the unwritten last checksum
					// byte happened to hold the new value already (1 in 256), the write
					// did complete, and both copies agree.
					complete := bytes.Equal(base.bytesAt(0, HeaderSize), base.bytesAt(copyB(base), HeaderSize))
					if torn > offSequence && h.Warning == nil && !(torn == HeaderSize-1 && complete) {
						t.Errorf("no warning about the torn copy")
					}
					mustUnlock(t, base, pass("pw0"), 0, mk)
					_, errOld := unlock(base, pass("pw2"), AnySlot)
					_, errNew := unlock(base, pass("new"), AnySlot)
					got := [2]bool{errOld == nil, errNew == nil}
					if got != oldState && got != op.newState {
						t.Errorf("neither old nor new state (pw2: %v, new: %v)", errOld, errNew)
					}
					// A crash while writing B (after A is synced) keeps the new state.
					if writes == 1 && got != op.newState {
						t.Errorf("crash in copy B lost the synced copy A (pw2: %v, new: %v)", errOld, errNew)
					}
				})
			}
		}
	}
}

func TestReadErrors(t *testing.T) {
	t.Parallel()
	ext4 := make([]byte, 2048)
	binary.LittleEndian.PutUint16(ext4[1080:], 0xEF53)
	cases := []struct {
		name  string
		setup func(p *memProvider)
		kind  error
		text  string
	}{
		{"zeroes", func(*memProvider) {}, ErrNotELI, "not an eli provider: no eli header at offset 0 or at the end (the first 4096 bytes are zero"},
		{"luks", func(p *memProvider) { p.put(0, []byte("LUKS\xba\xbe\x00\x02")) }, ErrNotELI, "first bytes look like 4c 55 4b 53 ba be 00 02"},
		{"ext4", func(p *memProvider) { p.put(0, ext4) }, ErrNotELI, "an ext2 filesystem"},
		{"geli", func(p *memProvider) { p.put(5, []byte{1}); p.put(p.Size()-512, []byte("GEOM::ELI")) }, ErrNotELI, "geli"},
		{"version 2", func(p *memProvider) {
			h := p.bytesAt(0, HeaderSize)
			binary.LittleEndian.PutUint32(h[offVersion:], 3)
			p.put(0, h)
			p.put(copyB(p), h)
		}, ErrVersion, "eli header version 3 at offset 0 is not supported"},
		{"garbage after the magic", func(p *memProvider) {
			junk := bytes.Repeat([]byte{0x83}, HeaderSize-len(magic))
			p.put(int64(len(magic)), junk)
			p.put(copyB(p)+int64(len(magic)), junk)
		}, ErrCorrupt, "checksum mismatch, and version field"},
		{"both corrupt", func(p *memProvider) {
			p.put(300, []byte{0xff})
			p.put(copyB(p)+300, []byte{0xff})
		}, ErrCorrupt, "both header copies are corrupt (eli header copy at offset 0 is corrupt"},
		{"A corrupt, B missing", func(p *memProvider) {
			p.put(300, []byte{0xff})
			p.put(copyB(p), make([]byte, HeaderSize))
		}, ErrCorrupt, "no valid eli header copy (eli header copy at offset 0 is corrupt (checksum mismatch); no eli header at offset"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var p *memProvider
			if tc.kind == ErrNotELI {
				p = newMem(testSize)
			} else {
				p, _ = newVolume(t)
			}
			tc.setup(p)
			_, err := Read(p)
			if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("Read = %v, want %v containing %q", err, tc.kind, tc.text)
			}
		})
	}

	t.Run("tiny provider", func(t *testing.T) {
		t.Parallel()
		for _, size := range []int64{0, 100, 4096, 8191} {
			if _, err := Read(newMem(size)); !errors.Is(err, ErrNotELI) {
				t.Errorf("size %d: Read = %v, want ErrNotELI", size, err)
			}
		}
	})
	t.Run("shrunk provider", func(t *testing.T) {
		t.Parallel()
		p, _ := newVolume(t)
		small := &memProvider{b: p.bytesAt(0, 1<<20)}
		small.put(copyB(small), p.bytesAt(0, HeaderSize))
		_, err := Read(small)
		if !errors.Is(err, ErrTooSmall) || !strings.Contains(err.Error(), "does not fit the provider (was it truncated or shrunk? it needs at least") {
			t.Errorf("Read = %v, want ErrTooSmall", err)
		}
	})
	t.Run("io error", func(t *testing.T) {
		t.Parallel()
		_, err := Read(failingReader{newMem(testSize)})
		if err == nil || kindOf(err) != nil || !strings.Contains(err.Error(), "read header copy A") {
			t.Errorf("Read = %v, want a plain I/O error", err)
		}
	})
}

type failingReader struct{ *memProvider }

func (failingReader) ReadAt([]byte, int64) (int, error) { return 0, errors.New("EIO") }

func TestGrownProviderWarnsAboutCopyB(t *testing.T) {
	t.Parallel()
	p, _ := newVolume(t)
	p.grow(8 << 20)
	h := mustRead(t, p)
	if h.Copy != CopyA || !errors.Is(h.Warning, ErrNotELI) || !strings.Contains(h.Warning.Error(), "eli resize moves copy B") {
		t.Errorf("copy %v warning %v", h.Copy, h.Warning)
	}
}

func TestDump(t *testing.T) {
	t.Parallel()
	p, mk := newVolume(t)
	if _, err := SetKey(p, mk, 4, Credentials{Passphrase: []byte("x"), Keyfiles: [][]byte{[]byte("k")}}, tiny); err != nil {
		t.Fatal(err)
	}
	p.put(copyB(p), make([]byte, 10))
	h := mustRead(t, p)
	d := h.Dump()
	for _, want := range []string{
		"version:        1", "sequence:       2", "mode:           xchacha20-poly1305",
		"sector size:    4096", "sectors:        500 (2048000 bytes)", "data offset:    131072",
		"journal offset: 65536", "journal length: 65536", "keyslots:       2 active of 8",
		"slot 0:         active, passphrase, argon2id t=1 m=64 KiB p=1, salt ",
		"slot 4:         active, passphrase+keyfiles", "slot 7:         empty",
		"warning:        no eli header at offset", "copy:           A (offset 0)",
	} {
		if !strings.Contains(d, want) {
			t.Errorf("dump lacks %q:\n%s", want, d)
		}
	}
	if strings.Contains(d, hex.EncodeToString(mk.Bytes()[:8])) {
		t.Error("dump shows the master key")
	}
}

// TestTornUpdateAfterTornCopy: an update that finds one copy corrupt (an earlier update
// was torn there) and is torn itself still leaves a valid copy: it writes the corrupt
// copy first and the valid one only once that is synced.
func TestTornUpdateAfterTornCopy(t *testing.T) {
	t.Parallel()
	for _, bad := range []Copy{CopyA, CopyB} {
		for _, torn := range []int{0, 1, 2048, 4095} {
			base, mk := newVolume(t)
			off := int64(0)
			if bad == CopyB {
				off = copyB(base)
			}
			raw := base.bytesAt(off, HeaderSize)
			raw[100] ^= 0xff // the checksum no longer matches
			base.put(off, raw)
			if h := mustRead(t, base); h.Copy == bad {
				t.Fatalf("copy %s was corrupted, yet Read chose it", bad)
			}
			c := &crashProvider{memProvider: base, writes: 0, torn: torn}
			if _, err := SetKey(c, mk, 1, pass("new"), tiny); !errors.Is(err, errCrashed) {
				t.Fatalf("SetKey = %v, want the simulated crash", err)
			}
			if _, err := Read(base); err != nil {
				t.Errorf("copy %s corrupt, update torn at %d bytes: %v", bad, torn, err)
				continue
			}
			mustUnlock(t, base, pass("pw0"), 0, mk)
		}
	}
}

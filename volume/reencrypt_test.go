package volume

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

var testPass = keys.Credentials{Passphrase: []byte("test")}

// reencVolume makes a volume of mode and format version on a file and returns its path.
func reencVolume(t *testing.T, version uint32, mode sector.Mode, size int64) string {
	t.Helper()
	path, _, mk := elitest.VolumeVersion(t, t.TempDir(), size, mode, version)
	mk.Wipe()
	return path
}

// openReenc opens the volume at path as a server would, unlocked with the passphrase.
func openReenc(t *testing.T, path string, ro bool) (*Volume, provider.Provider) {
	t.Helper()
	p, err := provider.Open(path, ro)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	mk, _, err := h.Unlock(testPass, keys.AnySlot)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	v, err := Open(p, mk, Options{ReadOnly: ro})
	if err != nil {
		t.Fatal(err)
	}
	v.sweep = blockdev.SweeperConfig{StepBytes: 256 << 10}
	return v, p
}

// prepareReenc prepares a re-encryption of p's volume as eli reencrypt does, in another
// process: the header's bytes and the new key, as they cross the control channel.
func prepareReenc(t *testing.T, p provider.Provider, mode sector.Mode) (header, key []byte) {
	t.Helper()
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	mk, _, err := h.Unlock(testPass, keys.AnySlot)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	pr, err := keys.PrepareReencrypt(h, mk, keys.ReencryptOptions{Mode: mode, Slots: map[int]keys.Credentials{0: testPass}})
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Wipe()
	return pr.Header(), bytes.Clone(pr.Key().Bytes())
}

// client writes random 4 KiB blocks to v and flushes every few writes, until stop; the
// model holds every block's last value (each write is flushed by the end).
type client struct {
	v     *Volume
	model []byte
	stop  chan struct{}
	done  chan error
}

func startClient(v *Volume, base []byte, seed uint64) *client {
	c := &client{v: v, model: bytes.Clone(base), stop: make(chan struct{}), done: make(chan error, 1)}
	go func() {
		rng := rand.New(rand.NewPCG(seed, 7))
		blocks := v.Size() / 4096
		buf := make([]byte, 4096)
		for n := 0; ; n++ {
			select {
			case <-c.stop:
				c.done <- v.Flush()
				return
			default:
			}
			off := rng.Int64N(blocks) * 4096
			for i := range buf {
				buf[i] = byte(rng.Uint32())
			}
			if err := v.WriteAt(buf, off, 0); err != nil {
				c.done <- err
				return
			}
			copy(c.model[off:], buf)
			if n%8 == 7 {
				if err := v.Flush(); err != nil {
					c.done <- err
					return
				}
			}
		}
	}()
	return c
}

func (c *client) finish(t *testing.T) []byte {
	t.Helper()
	close(c.stop)
	if err := <-c.done; err != nil {
		t.Fatalf("client: %v", err)
	}
	return c.model
}

func fill(t *testing.T, v *Volume, seed uint64) []byte {
	t.Helper()
	data := make([]byte, v.Size())
	rng := rand.New(rand.NewPCG(seed, 1))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	if err := v.WriteAt(data, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	return data
}

// waitReenc waits until v's re-encryption has the state want.
func waitReenc(t *testing.T, v *Volume, want string) *ReencryptStatus {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		st := v.Status().Reencrypt
		if st != nil && st.State == want {
			return st
		}
		if st != nil && st.State == ReencryptStopped {
			t.Fatalf("re-encryption stopped: %s", st.Error)
		}
		if time.Now().After(deadline) {
			t.Fatalf("re-encryption not %s: %+v", want, st)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// checkDone checks the volume at path after its re-encryption: the header holds no
// previous key and opens with the passphrase to a key other than old, and every byte is
// want.
func checkDone(t *testing.T, path string, epoch uint64, mode sector.Mode, want []byte) {
	t.Helper()
	v, p := openReenc(t, path, true)
	defer v.Close()
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	if r := h.Reencryption(); r != (keys.Reencryption{Epoch: epoch}) {
		t.Fatalf("header after the re-encryption: %+v", r)
	}
	if h.Mode != mode || v.Mode() != mode {
		t.Fatalf("mode %s (volume %s), want %s", h.Mode, v.Mode(), mode)
	}
	got := make([]byte, v.Size())
	if err := v.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if i := firstDiff(got, want); i >= 0 {
		t.Fatalf("byte %d (sector %d) differs after the re-encryption", i, i/4096)
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// TestOnlineReencrypt: an open volume re-encrypted while a client writes and flushes:
// the server writes the header's start from a start prepared elsewhere, sweeps, and
// ends with the old key gone; every flushed write is there afterwards, under the new
// key (the old one no longer opens the header).
func TestOnlineReencrypt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		version  uint32
		mode, to sector.Mode
	}{
		{"xchacha20-poly1305-v2", layout.Version2, sector.ModeXChaCha20Poly1305, 0},
		{"xchacha20-poly1305-v1", layout.Version1, sector.ModeXChaCha20Poly1305, 0},
		{"aes128-xts-to-aes-xts", layout.Version1, sector.ModeAESXTS128, sector.ModeAESXTS256},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := reencVolume(t, tc.version, tc.mode, 24<<20)
			v, p := openReenc(t, path, false)
			base := fill(t, v, 3)
			old, err := keys.Read(p)
			if err != nil {
				t.Fatal(err)
			}
			oldKey, _, err := old.Unlock(testPass, keys.AnySlot)
			if err != nil {
				t.Fatal(err)
			}
			defer oldKey.Wipe()
			c := startClient(v, base, 5)
			hdr, key := prepareReenc(t, p, tc.to)
			srv := &Server{vol: v}
			if err := srv.Reencrypt(hdr, key, ReencryptOptions{}); err != nil {
				t.Fatal(err)
			}
			clear(key)
			st := waitReenc(t, v, ReencryptDone)
			want := c.finish(t)
			if st.Moved == 0 || st.Epoch != 1 || st.Percent() != 100 {
				t.Fatalf("status at the end: %+v", st)
			}
			if err := v.Close(); err != nil {
				t.Fatal(err)
			}
			to := tc.to
			if to == 0 {
				to = tc.mode
			}
			checkDone(t, path, 1, to, want)
			h, err := keys.Read(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Verify(oldKey); err == nil {
				t.Fatal("the old master key still verifies the header")
			}
		})
	}
}

// TestOnlineReencryptStopResume: a volume closed halfway through its re-encryption (a
// detach) stops the sweep at a step's end with a checkpoint in the header; a second
// start is refused meanwhile, through the Volume and the Server; the next open resumes
// it (Start does, as soon as the server serves) and finishes it with every byte kept.
func TestOnlineReencryptStopResume(t *testing.T) {
	t.Parallel()
	path := reencVolume(t, layout.Version2, sector.ModeXChaCha20Poly1305, 24<<20)
	v, p := openReenc(t, path, false)
	data := fill(t, v, 9)
	halfway := make(chan struct{})
	var once sync.Once
	v.onStep = func(st blockdev.ReencryptStatus) {
		if st.Cursor >= st.Sectors/3 {
			once.Do(func() {
				v.re.on.Pause() // the sweeper holds before its next step
				close(halfway)
			})
		}
	}
	hdr, key := prepareReenc(t, p, 0)
	if err := v.Reencrypt(mustParse(t, hdr, key), ReencryptOptions{}); err != nil {
		t.Fatal(err)
	}
	<-halfway
	// The same start again (what a second eli reencrypt that read the header before
	// the first one's start would send).
	if err := (&Server{vol: v}).Reencrypt(hdr, key, ReencryptOptions{}); !errors.Is(err, keys.ErrReencrypting) {
		t.Fatalf("a second re-encryption through the server: %v", err)
	}
	if err := v.ResumeReencrypt(ReencryptOptions{}); !errors.Is(err, keys.ErrReencrypting) {
		t.Fatalf("resuming a running re-encryption: %v", err)
	}
	st := v.Status().Reencrypt
	if st == nil || st.State != ReencryptRunning || st.Cursor == 0 || st.Cursor >= st.Sectors {
		t.Fatalf("status halfway: %+v", st)
	}
	if err := v.Close(); err != nil {
		t.Fatal(err)
	}
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	r := h.Reencryption()
	if !r.Active || r.Cursor != st.Cursor {
		t.Fatalf("header after a stop halfway at sector %d: %+v", st.Cursor, r)
	}

	// Read-only: served with both keys, not swept, and not to be re-encrypted.
	ro, _ := openReenc(t, path, true)
	if st := ro.Status().Reencrypt; st == nil || st.State != ReencryptWaiting || st.Cursor != r.Cursor || st.Epoch != 1 {
		t.Fatalf("read-only status: %+v", st)
	}
	got := make([]byte, ro.Size())
	if err := ro.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("a volume halfway reads other data")
	}
	if err := ro.ResumeReencrypt(ReencryptOptions{}); err == nil {
		t.Fatal("a read-only volume resumed its re-encryption")
	}
	ro.Close()

	v2, _ := openReenc(t, path, false)
	if st := v2.Status().Reencrypt; st == nil || st.State != ReencryptStopped || st.Cursor != r.Cursor {
		t.Fatalf("status before the server serves: %+v", st)
	}
	v2.resumePending(ReencryptOptions{})
	st = waitReenc(t, v2, ReencryptDone)
	if st.Moved == 0 || st.Moved > st.Sectors-r.Cursor {
		t.Fatalf("the resumed sweep moved %d sectors of the %d from the checkpoint", st.Moved, st.Sectors-r.Cursor)
	}
	if err := v2.Close(); err != nil {
		t.Fatal(err)
	}
	checkDone(t, path, 1, sector.ModeXChaCha20Poly1305, data)
}

// TestOnlineReencryptSuspend: a suspend halfway through an online re-encryption holds
// the sweep between steps and records where it stands in the header before the keys go
// (so a server stopped while suspended loses no progress); meanwhile the sweep does not
// move, requests wait, a new start or a resume of the sweep is refused, and a second
// suspend too; a resume with the master key derives the previous keys again, lets the
// held read in (it reads what was written) and the sweep go on to the end.
func TestOnlineReencryptSuspend(t *testing.T) {
	t.Parallel()
	path := reencVolume(t, layout.Version1, sector.ModeXChaCha20Poly1305, 24<<20)
	v, p := openReenc(t, path, false)
	data := fill(t, v, 11)
	started := make(chan struct{})
	var once sync.Once
	v.onStep = func(st blockdev.ReencryptStatus) { once.Do(func() { close(started) }) }
	hdr, key := prepareReenc(t, p, 0)
	if err := v.Reencrypt(mustParse(t, hdr, key), ReencryptOptions{MaxRate: 8 << 20}); err != nil {
		t.Fatal(err)
	}
	<-started
	if err := v.Suspend(context.Background()); err != nil {
		t.Fatal(err)
	}
	st := v.Status().Reencrypt
	if st.State != ReencryptPaused {
		t.Fatalf("state while suspended: %+v", st)
	}
	h, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	if c := h.Reencryption().Cursor; c != st.Cursor || c == 0 {
		t.Fatalf("header checkpoint %d, the sweep stands at %d", c, st.Cursor)
	}
	if err := v.Suspend(context.Background()); !errors.Is(err, blockdev.ErrSuspended) {
		t.Fatalf("a second suspend: %v", err)
	}
	if err := v.ResumeReencrypt(ReencryptOptions{}); !errors.Is(err, blockdev.ErrSuspended) {
		t.Fatalf("a resume of the sweep while suspended: %v", err)
	}
	if err := v.Reencrypt(mustParse(t, hdr, key), ReencryptOptions{}); !errors.Is(err, blockdev.ErrSuspended) {
		t.Fatalf("a start while suspended: %v", err)
	}
	got := make([]byte, len(data))
	read := make(chan error, 1)
	go func() { read <- v.ReadAt(got, 0) }()
	mk, _, err := h.Unlock(testPass, keys.AnySlot)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	time.Sleep(200 * time.Millisecond) // the sweep would have moved meanwhile, and the read been answered
	if c := v.dev.Reencryption().Cursor; c != st.Cursor {
		t.Fatalf("the sweep moved while suspended: %d, then %d", st.Cursor, c)
	}
	select {
	case err := <-read:
		t.Fatalf("a read was answered while suspended: %v", err)
	default:
	}
	if err := v.Resume(mk); err != nil {
		t.Fatal(err)
	}
	if err := <-read; err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the read held while suspended: %v, same data: %v", err, bytes.Equal(got, data))
	}
	if err := v.SetReencryptRate(0); err != nil {
		t.Fatal(err)
	}
	waitReenc(t, v, ReencryptDone)
	if err := v.Close(); err != nil {
		t.Fatal(err)
	}
	checkDone(t, path, 1, sector.ModeXChaCha20Poly1305, data)
}

func mustParse(t *testing.T, hdr, key []byte) *keys.PreparedReencrypt {
	t.Helper()
	pr, err := keys.ParsePrepared(hdr, key)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pr.Wipe)
	return pr
}

package blockdev

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// The crash simulation of re-encryption (issue 41). A volume with a real header (keys/)
// holding data under its first master key is recorded while a re-encryption runs on it:
// the header's start (keyslots re-wrapped, the previous key sealed in), sweep steps and
// checkpoints interleaved with a random client workload (crashClient), the end of the
// sweep, the header's end and the device's forgetting of the previous key, and more
// client work. Then, at every crash point (a prefix of the recorded I/O, the unsynced
// writes kept, lost or torn as in crash_test.go):
//
//   - the header unlocks with the passphrase and the volume attaches with the keys it
//     names (both while it says a re-encryption is under way);
//   - every sector reads as a value it held since its last flush: never an I/O error,
//     never what the other key makes of it;
//   - the re-encryption resumes (Sweeper, checkpoints and the end in the header) and
//     finishes, every sector still reading the same, and then the header holds no
//     previous key, no keyslot opens the first master key, and the volume opens with the
//     new keys alone;
//   - at some crash points the resumed re-encryption is itself recorded and crashed, and
//     the result must read the same and resume again.
//
// Both format versions are covered, and the length-preserving modes' hotzone (with a
// change of mode), each with steps that do not line up with groups or windows.

var (
	reencKDF  = keys.KDFParams{Time: 1, MemoryKiB: 8, Threads: 1}
	reencPass = keys.Credentials{Passphrase: []byte("reencrypt test")}
)

type reencVariant struct {
	name       string
	version    uint32
	from, to   sector.Mode
	sectorSize int
	sectors    uint64
	unit       int64
	cacheBytes int64
	mapped     bool
	// concurrent: a Sweeper runs in its own goroutine, checkpointing and ending in the
	// header, while the client works (the recorded order then varies from run to run).
	concurrent bool
	// online: the re-encryption starts on a device that serves, as an attached volume's
	// does (reencrypt.StartOnline): the client works under the first key, with writes
	// pending, when the header's start (prepared elsewhere, keys.CommitReencrypt) is
	// written and the device switches keys, and the recording begins before both.
	online bool
	seeds  int // 3 when 0
}

func TestReencryptCrash(t *testing.T) {
	t.Parallel()
	variants := []reencVariant{
		{name: "v1-512", from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 512, sectors: 330, unit: 512},
		{name: "v1-4096-mapped", from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 4096, sectors: 250, unit: 4096, mapped: true},
		{name: "v1-512-rounds", from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 512, sectors: 330, unit: 512, cacheBytes: 2 * 4096},
		{name: "v2-4096", version: layout.Version2, from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 4096, sectors: 250, unit: 4096},
		{name: "v2-512-rounds-mapped", version: layout.Version2, from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 512, sectors: 330, unit: 512, cacheBytes: 2 * 4096, mapped: true},
		{name: "aes-xts-512", from: sector.ModeAESXTS256, to: sector.ModeAESXTS256, sectorSize: 512, sectors: 700, unit: 512},
		{name: "aes128-to-aes-xts-4096", from: sector.ModeAESXTS128, to: sector.ModeAESXTS256, sectorSize: 4096, sectors: 250, unit: 4096, mapped: true},
		{name: "none-to-aes-xts-512", from: sector.ModeNone, to: sector.ModeAESXTS256, sectorSize: 512, sectors: 400, unit: 512},
		{name: "v1-4096-concurrent", from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 4096, sectors: 250, unit: 4096, concurrent: true},
		{name: "v2-512-concurrent", version: layout.Version2, from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 512, sectors: 330, unit: 512, concurrent: true},
		{name: "aes-xts-512-concurrent", from: sector.ModeAESXTS256, to: sector.ModeAESXTS256, sectorSize: 512, sectors: 700, unit: 512, concurrent: true},
		{name: "v1-4096-online", from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 4096, sectors: 250, unit: 4096, online: true},
		{name: "v2-512-online-concurrent", version: layout.Version2, from: sector.ModeXChaCha20Poly1305, to: sector.ModeXChaCha20Poly1305, sectorSize: 512, sectors: 330, unit: 512, online: true, concurrent: true},
		{name: "aes128-to-aes-xts-512-online", from: sector.ModeAESXTS128, to: sector.ModeAESXTS256, sectorSize: 512, sectors: 700, unit: 512, online: true},
	}
	var total atomic.Int64
	t.Run("variants", func(t *testing.T) {
		for _, v := range variants {
			t.Run(v.name, func(t *testing.T) {
				t.Parallel()
				n := 3
				if v.seeds > 0 {
					n = v.seeds
				}
				for _, seed := range crashSeeds(t, n) {
					total.Add(int64(runReencryptCrash(t, v, seed)))
				}
			})
		}
	})
	if t.Failed() {
		return
	}
	n := total.Load()
	t.Logf("%d crash points checked", n)
	if n < 1000 && !testing.Short() && !raceEnabled && os.Getenv("ELI_CRASH_SEED") == "" {
		t.Fatalf("only %d crash points: the workload is too small to show anything", n)
	}
}

// openFromHeader attaches p as eli does: the header unlocked with reencPass, the device
// opened with the keys it names, both while a re-encryption is under way. The returned
// function wipes the codecs and the master key.
func openFromHeader(p provider.Provider, base Config) (*Device, *keys.Header, *keys.MasterKey, func(), error) {
	h, err := keys.Read(p)
	if err != nil {
		return nil, nil, nil, nil, fmt.Errorf("read header: %w", err)
	}
	mk, _, err := h.Unlock(reencPass, keys.AnySlot)
	if err != nil {
		return nil, nil, nil, nil, fmt.Errorf("unlock: %w", err)
	}
	var codecs []sector.Codec
	cleanup := func() {
		for _, c := range codecs {
			c.Wipe()
		}
		mk.Wipe()
	}
	codecOf := func(k *keys.MasterKey, mode sector.Mode) (sector.Codec, []byte, error) {
		dk, jk := k.DataKey(mode), k.JournalKey()
		defer dk.Wipe()
		c, err := sector.New(sector.Params{Mode: mode, SectorSize: h.SectorSize, Key: dk.Bytes(), VolumeID: k.VolumeID()})
		j := bytes.Clone(jk.Bytes())
		jk.Wipe()
		if err == nil {
			codecs = append(codecs, c)
		}
		return c, j, err
	}
	cfg := base
	cfg.Layout = h.Layout
	if cfg.Codec, cfg.JournalKey, err = codecOf(mk, h.Mode); err != nil {
		cleanup()
		return nil, nil, nil, nil, err
	}
	if r := h.Reencryption(); r.Active {
		prev, err := h.PreviousKey(mk)
		if err != nil {
			cleanup()
			return nil, nil, nil, nil, err
		}
		re := &Reencrypt{Epoch: r.Epoch, Cursor: r.Cursor}
		re.Prev, re.PrevJournalKey, err = codecOf(prev, r.PrevMode)
		prev.Wipe()
		if err != nil {
			cleanup()
			return nil, nil, nil, nil, err
		}
		cfg.Reencrypt = re
	}
	d, err := Open(p, cfg)
	if err != nil {
		cleanup()
		return nil, nil, nil, nil, err
	}
	return d, h, mk, cleanup, nil
}

// resumeReencrypt runs a re-encryption the header says is under way to its end.
func resumeReencrypt(d *Device, p provider.Provider, mk *keys.MasterKey, stepBytes int64) error {
	sw := NewSweeper(d, SweeperConfig{
		StepBytes: stepBytes, Yield: -1, CheckpointBytes: 3 * stepBytes,
		Checkpoint: func(c uint64) error { return keys.SetReencryptCursor(p, mk, c) },
		Finish:     func() error { return keys.FinishReencrypt(p, mk) },
	})
	return sw.Run(context.Background())
}

func runReencryptCrash(t *testing.T, v reencVariant, seed uint64) (points int) {
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("variant %s seed %d (rerun with ELI_CRASH_SEED=%d): %s", v.name, seed, seed, fmt.Sprintf(format, args...))
	}
	l, size := layoutForVersion(t, v.version, v.from, v.sectorSize, v.sectors, layout.Align)
	if testFormat2 && v.version == 0 && l.Tree() {
		v.version = layout.Version2
	}
	auth := l.Authenticated()
	mem := newMem(size)
	mk0, err := keys.Create(mem, l, reencPass, reencKDF)
	if err != nil {
		t.Fatal(err)
	}
	defer mk0.Wipe()
	if err := Format(mem, l); err != nil {
		t.Fatal(err)
	}
	base := Config{Logger: discardLogger(), CommitInterval: time.Hour, MaxBatchBytes: 1 << 30, CacheBytes: v.cacheBytes}
	rng := rand.New(rand.NewPCG(seed, 0x4ee1))

	// Data under the first key, written before the recording starts.
	d, _, _, cleanup, err := openFromHeader(mem, base)
	if err != nil {
		t.Fatal(err)
	}
	pre := make([]byte, d.Size())
	randFill(rng, pre)
	if err := d.WriteAt(pre, 0, 0); err != nil {
		t.Fatal(err)
	}
	if auth {
		s := int64(v.sectorSize)
		if err := d.Trim(7*s, 20*s, 0); err != nil { // sectors the sweep skips
			t.Fatal(err)
		}
		clear(pre[7*s : 27*s])
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	cleanup()

	rec := newRecorder(mem.data)
	rec.mapped = v.mapped
	var mk1 *keys.MasterKey
	if !v.online {
		if mk1, err = keys.BeginReencrypt(rec, mk0, keys.ReencryptOptions{Mode: v.to, Slots: map[int]keys.Credentials{0: reencPass}}); err != nil {
			t.Fatal(err)
		}
		defer mk1.Wipe()
	}
	d, _, mk, cleanup, err := openFromHeader(rec, base)
	if err != nil {
		t.Fatal(err)
	}
	w := newCrashClient(d, rec, rng, v.sectors, v.sectorSize, fail)
	w.noTrim = !auth
	copy(w.model, pre)
	w.m.initial = make([]uint64, v.sectors)
	for i := range w.m.initial {
		s := int64(v.sectorSize)
		w.m.initial[i] = sectorHash(pre[int64(i)*s : int64(i+1)*s])
	}
	if v.online {
		// Client work under the first key, some of it pending, then the start: the
		// header (prepared from the header read before, as eli reencrypt does in its
		// process), then the device's switch, with no flush in between.
		for range 12 {
			w.op()
		}
		h, err := keys.Read(rec)
		if err != nil {
			fail("read the header: %v", err)
		}
		pr, err := keys.PrepareReencrypt(h, mk0, keys.ReencryptOptions{Mode: v.to, Slots: map[int]keys.Credentials{0: reencPass}})
		if err != nil {
			fail("prepare: %v", err)
		}
		defer pr.Wipe()
		if err := keys.CommitReencrypt(rec, pr); err != nil {
			fail("start in the header: %v", err)
		}
		mode := v.to
		if mode == 0 {
			mode = v.from
		}
		dk, jk := pr.Key().DataKey(mode), pr.Key().JournalKey()
		c, err := sector.New(sector.Params{Mode: mode, SectorSize: v.sectorSize, Key: dk.Bytes(), VolumeID: pr.Key().VolumeID()})
		dk.Wipe()
		if err != nil {
			fail("codec: %v", err)
		}
		defer c.Wipe()
		err = d.StartReencrypt(c, jk.Bytes(), 1)
		jk.Wipe()
		if err != nil {
			fail("start on the device: %v", err)
		}
		mk = pr.Key()
		for range 6 {
			w.op()
		}
	}
	sweeps, checkpoints := 0, 0
	if v.concurrent {
		sw := NewSweeper(d, SweeperConfig{
			StepBytes: int64(v.sectorSize) * 9, Yield: -1, CheckpointBytes: int64(v.sectorSize) * 40,
			Checkpoint: func(c uint64) error { checkpoints++; return keys.SetReencryptCursor(rec, mk, c) },
			Finish:     func() error { return keys.FinishReencrypt(rec, mk) },
			OnProgress: func(ReencryptStatus) { sweeps++ },
		})
		done := make(chan error, 1)
		go func() { done <- sw.Run(context.Background()) }()
		// At most 80 operations meanwhile: they bound the crash points to check.
		for k := 0; ; k++ {
			if k == 80 {
				if err := <-done; err != nil {
					fail("sweeper: %v", err)
				}
				break
			}
			select {
			case err := <-done:
				if err != nil {
					fail("sweeper: %v", err)
				}
			default:
				w.op()
				continue
			}
			break
		}
	}
	for !v.concurrent {
		st := d.Reencryption()
		if st.Cursor == st.Sectors {
			break
		}
		k := rng.IntN(10)
		if checkpoints == 0 && sweeps >= 2 {
			k = 4
		}
		switch {
		case k < 4:
			if _, err := d.Sweep(uint64(1 + rng.IntN(60))); err != nil {
				fail("sweep: %v", err)
			}
			sweeps++
		case k < 5:
			op := crashOp{kind: opFlush, durableAll: true, evStart: rec.numEvents()}
			if err := d.Flush(); err != nil {
				fail("checkpoint: flush: %v", err)
			}
			if err := keys.SetReencryptCursor(rec, mk, st.Cursor); err != nil {
				fail("checkpoint: %v", err)
			}
			w.note(op)
			checkpoints++
		default:
			w.op()
		}
	}
	if !v.concurrent {
		op := crashOp{kind: opFlush, durableAll: true, evStart: rec.numEvents()}
		if err := d.FinishSweep(); err != nil {
			fail("finish sweep: %v", err)
		}
		w.note(op)
		if err := keys.FinishReencrypt(rec, mk); err != nil {
			fail("finish in the header: %v", err)
		}
		if err := d.ForgetPrevious(); err != nil {
			fail("forget the previous key: %v", err)
		}
	}
	for range 8 {
		w.op()
	}
	w.close()
	cleanup()
	if sweeps == 0 || checkpoints == 0 {
		fail("the workload made %d sweep steps and %d checkpoints", sweeps, checkpoints)
	}

	step := 1
	if raceEnabled || testing.Short() {
		step = 7
	}
	events := rec.numEvents()
	stepBytes := int64(v.sectorSize) * int64(1+rng.IntN(40))
	midSweep, moved := 0, uint64(0) // crash points that attach halfway, sectors resumes move
	defer func() {
		if !t.Failed() && (midSweep == 0 || moved == 0) {
			t.Errorf("variant %s seed %d: %d crash points attached halfway through the sweep, resumes moved %d sectors: nothing was exercised", v.name, seed, midSweep, moved)
		}
	}()
	for c := 0; c <= events; c += step {
		img, _ := rec.crashImage(c, v.unit, rng)
		points++
		p := &memProvider{data: img}
		got := w.m.checkAfterCrash(p, base, c, "recovered", fail)
		if c%5 == 2 {
			// Crash again in the resumed re-encryption, then resume that.
			r2 := newRecorder(img)
			r2.mapped = v.mapped
			d2, _, mk2, cl2, err := openFromHeader(r2, base)
			if err != nil {
				fail("crash point %d: attach: %v", c, err)
			}
			if d2.Reencryption().Active {
				if err := resumeReencrypt(d2, r2, mk2, stepBytes); err != nil {
					fail("crash point %d: resume: %v", c, err)
				}
			}
			if err := d2.Close(); err != nil {
				fail("crash point %d: close: %v", c, err)
			}
			cl2()
			c2 := rng.IntN(r2.numEvents() + 1)
			img2, _ := r2.crashImage(c2, v.unit, rng)
			p = &memProvider{data: img2}
			if again := w.m.checkAfterCrash(p, base, c, fmt.Sprintf("resume crashed at event %d of %d", c2, r2.numEvents()), fail); !equalHashes(again, got) {
				fail("crash point %d: the resumed re-encryption, crashed at %d, changed what sectors read", c, c2)
			}
		}
		d2, _, mk2, cl2, err := openFromHeader(p, base)
		if err != nil {
			fail("crash point %d: attach: %v", c, err)
		}
		if st := d2.Reencryption(); st.Active {
			if st.Cursor > 0 {
				midSweep++
			}
			var last ReencryptStatus
			sw := NewSweeper(d2, SweeperConfig{
				StepBytes: stepBytes, Yield: -1, CheckpointBytes: 3 * stepBytes,
				Checkpoint: func(c uint64) error { return keys.SetReencryptCursor(p, mk2, c) },
				Finish:     func() error { return keys.FinishReencrypt(p, mk2) },
				OnProgress: func(st ReencryptStatus) {
					if st.Active {
						last = st
					}
				},
			})
			if err := sw.Run(context.Background()); err != nil {
				fail("crash point %d: resume: %v", c, err)
			}
			moved += last.Moved
		}
		after, _ := w.m.check(d2, c, "after the resumed re-encryption", false, fail)
		if !equalHashes(after, got) {
			fail("crash point %d: the resumed re-encryption changed what sectors read", c)
		}
		if err := d2.Close(); err != nil {
			fail("crash point %d: close: %v", c, err)
		}
		cl2()
		checkReencryptEnded(p, mk0, base, after, c, fail)
	}
	return points
}

// checkAfterCrash attaches p after a crash at event c and checks every sector.
func (m *crashModel) checkAfterCrash(p provider.Provider, base Config, c int, stage string, fail func(string, ...any)) []uint64 {
	d, _, _, cleanup, err := openFromHeader(p, base)
	if err != nil {
		fail("crash point %d (%s): attach: %v", c, stage, err)
	}
	defer cleanup()
	got, _ := m.check(d, c, stage, false, fail)
	if err := d.Close(); err != nil {
		fail("crash point %d (%s): close: %v", c, stage, err)
	}
	return got
}

// checkReencryptEnded: after the resumed re-encryption, a volume whose header had begun
// one holds no previous key, no keyslot opens the first master key (mk0), and the new
// keys alone read every sector as before. A crash before the header's start was durable
// leaves the volume as it was, under mk0.
func checkReencryptEnded(p *memProvider, mk0 *keys.MasterKey, base Config, want []uint64, c int, fail func(string, ...any)) {
	h, err := keys.Read(p)
	if err != nil {
		fail("crash point %d: header after the end: %v", c, err)
	}
	r := h.Reencryption()
	if r.Active {
		fail("crash point %d: the header still holds the previous key after the re-encryption ran to its end", c)
	}
	mk, _, err := h.Unlock(reencPass, keys.AnySlot)
	if err != nil {
		fail("crash point %d: unlock after the end: %v", c, err)
	}
	defer mk.Wipe()
	if r.Epoch == 0 {
		if !bytes.Equal(mk.Bytes(), mk0.Bytes()) {
			fail("crash point %d: epoch 0 with another master key", c)
		}
		return
	}
	if bytes.Equal(mk.Bytes(), mk0.Bytes()) {
		fail("crash point %d: a keyslot still opens the first master key", c)
	}
	if bytes.Contains(p.data[:layout.HeaderRegionLen], mk0.Bytes()) {
		fail("crash point %d: the first master key is in the clear in the header region", c)
	}
	d, _, _, cleanup, err := openFromHeader(p, base)
	if err != nil {
		fail("crash point %d: attach with the new key alone: %v", c, err)
	}
	defer cleanup()
	if d.Reencryption().Active {
		fail("crash point %d: the device holds a previous key", c)
	}
	buf := make([]byte, d.SectorSize())
	for i, h := range want {
		if err := d.ReadAt(buf, int64(i)*int64(len(buf))); err != nil || sectorHash(buf) != h {
			fail("crash point %d: with the new key alone, sector %d: %v", c, i, err)
		}
	}
	if err := d.Close(); err != nil {
		fail("crash point %d: close: %v", c, err)
	}
}

func equalHashes(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

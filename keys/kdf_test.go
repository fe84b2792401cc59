package keys

import (
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestKDFValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		p  KDFParams
		ok bool
	}{
		{KDFParams{1, 8, 1}, true},
		{KDFParams{1000, MaxKDFMemoryKiB, 255}, true},
		{KDFParams{0, 64, 1}, false},
		{KDFParams{1001, 64, 1}, false},
		{KDFParams{1, 64, 0}, false},
		{KDFParams{1, 7, 1}, false},
		{KDFParams{1, 8*4 - 1, 4}, false},
		{KDFParams{1, MaxKDFMemoryKiB + 1, 1}, false},
		{KDFParams{1, ^uint32(0), 1}, false},
	} {
		err := tc.p.Validate()
		if (err == nil) != tc.ok || (err != nil && (!errors.Is(err, ErrKDFParams) || !strings.Contains(err.Error(), "KDF parameters out of range"))) {
			t.Errorf("%+v: Validate = %v, want ok %v", tc.p, err, tc.ok)
		}
	}
}

// A header asking for more than the bounds is refused before any Argon2 runs.
func TestHostileKDFParamsRefused(t *testing.T) {
	t.Parallel()
	p, _ := newVolume(t)
	good := p.bytesAt(0, HeaderSize)
	for _, tc := range []struct {
		name string
		off  int
		val  []byte
	}{
		{"memory 4 GiB + 1 KiB", slotMemory, []byte{1, 0, 0x40, 0}},
		{"memory 2^32-1 KiB", slotMemory, []byte{0xff, 0xff, 0xff, 0xff}},
		{"1001 passes", slotTime, []byte{0xe9, 3, 0, 0}},
		{"0 threads", slotThreads, []byte{0}},
		{"KDF 2", slotKDF, []byte{2}},
	} {
		raw := append([]byte(nil), good...)
		copy(raw[offSlots+tc.off:], tc.val)
		q := p.clone()
		rewrite(q, 0, raw)
		rewrite(q, copyB(q), raw)
		start := time.Now()
		_, err := Read(q)
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "keyslot 0") {
			t.Errorf("%s: Read = %v, want the keyslot refused", tc.name, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s: refusing took %v", tc.name, d)
		}
	}
}

func TestCalibrate(t *testing.T) {
	t.Parallel()
	short, err := Calibrate(20*time.Millisecond, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	long, err := Calibrate(400*time.Millisecond, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	if short.MemoryKiB != 8192 || short.Threads != 1 || short.Time < 1 || short.Validate() != nil {
		t.Errorf("Calibrate(20ms, 8 MiB, 1) = %+v", short)
	}
	// How many passes a target buys depends on the machine's load while it measures (on a
	// busy CI machine a pass can take so long that 400ms buys a single one), so on the
	// real clock only validity is checked; TestCalibrateModel checks the arithmetic.
	if long.MemoryKiB != 8192 || long.Threads != 1 || long.Validate() != nil {
		t.Errorf("Calibrate(400ms, 8 MiB, 1) = %+v", long)
	}
	t.Logf("8 MiB, 1 thread: %d passes for 20ms, %d for 400ms", short.Time, long.Time)

	def, err := Calibrate(10*time.Millisecond, 8, 0)
	if err != nil {
		t.Fatal(err)
	}
	if want := min(4, runtime.NumCPU()); int(def.Threads) != want {
		t.Errorf("default threads %d, want %d", def.Threads, want)
	}
	if _, err := Calibrate(time.Millisecond, 8, 256); !errors.Is(err, ErrKDFParams) {
		t.Errorf("256 threads: %v", err)
	}
	if _, err := Calibrate(time.Millisecond, 5000, 1); !errors.Is(err, ErrKDFParams) {
		t.Errorf("5000 MiB: %v", err)
	}
}

// calibrate's arithmetic, against a machine model where a pass costs perMiB per MiB.
func TestCalibrateModel(t *testing.T) {
	t.Parallel()
	const gib = 1 << 30
	for _, tc := range []struct {
		name       string
		perMiB     time.Duration
		target     time.Duration
		mib        int
		avail      uint64
		wantMiB    uint32
		wantPasses uint32
	}{
		{"fast machine", time.Millisecond / 2, time.Second, 0, 64 * gib, 512, 4},       // 256ms a pass
		{"just right", 2 * time.Millisecond, time.Second, 0, 64 * gib, 512, 1},         // 1.024s
		{"slow: scale memory", 3 * time.Millisecond, time.Second, 0, 64 * gib, 333, 1}, // 1.536s > 1.5s
		{"very slow: floor", 10 * time.Millisecond, time.Second, 0, 64 * gib, 256, 1},
		{"explicit memory never scaled", 10 * time.Millisecond, time.Second, 1024, 64 * gib, 1024, 1},
		{"small machine", 10 * time.Millisecond, time.Second, 0, gib / 2, 128, 1},
		{"pass cap", time.Microsecond, time.Hour, 8, 64 * gib, 8, MaxKDFTime},
	} {
		calls := 0
		p, err := calibrate(tc.target, tc.mib, 2, tc.avail, func(p KDFParams) (time.Duration, error) {
			calls++
			return time.Duration(p.MemoryKiB/1024) * tc.perMiB, nil
		})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if p.MemoryKiB != tc.wantMiB*1024 || p.Time != tc.wantPasses || p.Threads != 2 || calls > 2 {
			t.Errorf("%s: %v after %d measurements, want %d MiB, %d passes", tc.name, p, calls, tc.wantMiB, tc.wantPasses)
		}
	}
}

func TestDefaultMemory(t *testing.T) {
	t.Parallel()
	const gib = 1 << 30
	for _, tc := range []struct {
		avail uint64
		want  int
	}{
		{0, 512},        // unknown: the default
		{64 * gib, 512}, // plenty: the default
		{2 * gib, 512},  // a quarter is exactly the default
		{1 * gib, 256},  // a quarter of RAM
		{256 << 20, 64}, // small machine: the fraction wins over the 256 MiB floor
		{1 << 20, 8},    // absurdly small: never below 8 MiB
	} {
		if got := defaultMemory(tc.avail); got != tc.want {
			t.Errorf("defaultMemory(%d MiB) = %d, want %d", tc.avail>>20, got, tc.want)
		}
	}
	if availableMemory() == 0 {
		t.Error("availableMemory found neither sysinfo nor a cgroup limit")
	}
}

// A realistic small slot (8 MiB, as the brief's tests use) round-trips too.
func TestEightMiBSlot(t *testing.T) {
	t.Parallel()
	p := newMem(testSize)
	mk, err := Create(p, testLayout(), pass("eight"), KDFParams{Time: 1, MemoryKiB: 8192, Threads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	mustUnlock(t, p, pass("eight"), 0, mk)
}

func TestFixed(t *testing.T) {
	p, err := Fixed(3, 16, 2)
	if err != nil || p != (KDFParams{Time: 3, MemoryKiB: 16 << 10, Threads: 2}) {
		t.Fatalf("Fixed(3, 16, 2) = %v, %v", p, err)
	}
	d, err := Fixed(1, 0, 0)
	if err != nil || d.MemoryKiB < 8<<10 || d.Threads < 1 {
		t.Fatalf("Fixed defaults = %v, %v", d, err)
	}
	for _, bad := range [][3]int{{0, 16, 1}, {1001, 16, 1}, {1, 16, 256}, {1, 5 << 10, 1}} {
		if _, err := Fixed(bad[0], bad[1], bad[2]); !errors.Is(err, ErrKDFParams) {
			t.Errorf("Fixed%v: %v, want ErrKDFParams", bad, err)
		}
	}
}

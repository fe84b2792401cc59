package keys

import (
	"testing"
	"time"
)

// BenchmarkCalibratedUnlock measures how close an unlock comes to the time Calibrate aimed
// for: the "x-target" metric is (time per Unlock) / target. Run it with a small count,
// e.g. go test ./keys -run XXX -bench CalibratedUnlock -benchtime 5x -count 3.
func BenchmarkCalibratedUnlock(b *testing.B) {
	for _, tc := range []struct {
		name    string
		target  time.Duration
		mib     int
		threads int
	}{
		{"64MiB-1thread-250ms", 250 * time.Millisecond, 64, 1},
		{"64MiB-2threads-250ms", 250 * time.Millisecond, 64, 2},
		{"256MiB-2threads-1s", time.Second, 256, 2},
	} {
		b.Run(tc.name, func(b *testing.B) {
			kdf, err := Calibrate(tc.target, tc.mib, tc.threads)
			if err != nil {
				b.Fatal(err)
			}
			p := newMem(testSize)
			mk, err := Create(p, testLayout(), pass("bench"), kdf)
			if err != nil {
				b.Fatal(err)
			}
			mk.Wipe()
			h, err := Read(p)
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			start := time.Now()
			for b.Loop() {
				k, _, err := h.Unlock(pass("bench"), AnySlot)
				if err != nil {
					b.Fatal(err)
				}
				k.Wipe()
			}
			per := time.Since(start) / time.Duration(b.N)
			b.ReportMetric(float64(per)/float64(tc.target), "x-target")
			b.ReportMetric(float64(kdf.Time), "passes")
		})
	}
}

package volume

import (
	"testing"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// BenchmarkRead4K compares a 4 KiB read through the Volume (the backend nbd calls: flag
// and error mapping, counters) with the same read on the device directly, from every
// core at once, where shared counters would cost the most.
func BenchmarkRead4K(b *testing.B) {
	path, _, mk := testVolume(b, b.TempDir(), 64<<20, sector.Default)
	defer mk.Wipe()
	p, err := provider.Open(path, false)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	v, err := Open(p, copyKey(b, mk), Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer v.Close()
	if err := v.WriteAt(make([]byte, 16<<20), 0, 0); err != nil {
		b.Fatal(err)
	}
	v.Flush()
	for _, tc := range []struct {
		name string
		read func([]byte, int64) error
	}{
		{"device", func(buf []byte, off int64) error { return v.dev.ReadAt(buf, off) }},
		{"volume", v.ReadAt},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(4096)
			b.RunParallel(func(pb *testing.PB) {
				buf := make([]byte, 4096)
				off := int64(0)
				for pb.Next() {
					if err := tc.read(buf, off); err != nil {
						b.Error(err)
						return
					}
					off = (off + 4096) % (16 << 20)
				}
			})
		})
	}
}

package tree

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkRecordChange is what one sector's new record costs the tree's leaf: 40 bytes
// of a 4 KiB metadata block changed, its digest taken again.
func BenchmarkRecordChange(b *testing.B) {
	block := make([]byte, 4096)
	var h Hasher
	h.Reset(block)
	rng := rand.New(rand.NewPCG(1, 1))
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		off := rng.IntN(102) * 40
		block[off] = byte(i)
		h.Update(block, off, 40)
		_ = h.Digest(0, uint64(i))
	}
}

// BenchmarkBlockDigest hashes a whole 4 KiB block, what loading a metadata block costs.
func BenchmarkBlockDigest(b *testing.B) {
	block := make([]byte, 4096)
	block[0] = 1
	b.SetBytes(4096)
	for b.Loop() {
		_ = BlockDigest(0, 1, block)
	}
}

// BenchmarkUpdate commits 32 random leaves at a time (a commit of 4 KiB random writes at
// queue depth 32, flushed after each) and 1024 (a commit of 1 MiB of them, where nothing
// flushes sooner) over the leaves of a 1 GiB and a 1 TiB volume; ns/op is per commit.
func BenchmarkUpdate(b *testing.B) {
	for _, c := range []struct {
		name   string
		leaves uint64
		batch  int
	}{
		{"1GiB/32", 1 << 30 / (102 * 4096), 32}, {"1TiB/32", 1 << 40 / (102 * 4096), 32},
		{"1GiB/1024", 1 << 30 / (102 * 4096), 1024}, {"1TiB/1024", 1 << 40 / (102 * 4096), 1024},
	} {
		b.Run(c.name, func(b *testing.B) {
			s := newMemStore()
			tr := New(NewGeometry(c.leaves), s, Digest{}, 1<<16)
			rng := rand.New(rand.NewPCG(2, 2))
			batch := make([]Leaf, c.batch)
			for b.Loop() {
				for i := range batch {
					batch[i] = Leaf{rng.Uint64N(c.leaves), randDigest(rng)}
				}
				cm, err := tr.Update(batch)
				if err != nil {
					b.Fatal(err)
				}
				s.write(cm)
				tr.Written(cm)
			}
		})
	}
}

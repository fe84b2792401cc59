package sysvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/elidisk/eli/nbd"
	"github.com/elidisk/eli/nbdclient"
)

func newTestDisk(t *testing.T, size int64) *Disk {
	t.Helper()
	d, err := CreateDisk(filepath.Join(t.TempDir(), "disk.img"), size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func fill(b byte, n int) []byte { return bytes.Repeat([]byte{b}, n) }

// durable reads [off, off+n) of the disk's file, where only durable data is.
func durable(t *testing.T, d *Disk, off int64, n int) []byte {
	t.Helper()
	b, err := os.ReadFile(d.Path())
	if err != nil {
		t.Fatal(err)
	}
	return b[off : off+int64(n)]
}

func mustRead(t *testing.T, b nbd.Backend, off int64, n int) []byte {
	t.Helper()
	p := make([]byte, n)
	if err := b.ReadAt(p, off); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDiskCutLosesWhatWasNotFlushed(t *testing.T) {
	d := newTestDisk(t, 16*BlockSize)
	b := d.Backend()
	if err := b.WriteAt(fill('a', BlockSize), 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := b.Flush(); err != nil {
		t.Fatal(err)
	}
	// Unflushed: a rewrite of block 0 and a write of blocks 1-2.
	b.WriteAt(fill('b', BlockSize), 0, 0)
	b.WriteAt(fill('c', 2*BlockSize), BlockSize, 0)
	if got := mustRead(t, b, 0, 3*BlockSize); !bytes.Equal(got, append(fill('b', BlockSize), fill('c', 2*BlockSize)...)) {
		t.Fatalf("reads do not see the unflushed writes")
	}
	if !bytes.Equal(durable(t, d, 0, BlockSize), fill('a', BlockSize)) {
		t.Fatalf("an unflushed write reached the file")
	}
	if n := d.Unflushed(); n != 3 {
		t.Fatalf("Unflushed = %d, want 3", n)
	}
	st, err := d.Cut(LoseAll, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st != (CutStats{Writes: 2, Lost: 2, LostBlocks: 3, TotalBlocks: 3}) {
		t.Fatalf("cut stats %+v", st)
	}
	if err := b.ReadAt(make([]byte, BlockSize), 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("a backend from before the cut read: %v, want EIO", err)
	}
	if err := b.WriteAt(fill('x', BlockSize), 0, 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("a backend from before the cut wrote: %v, want EIO", err)
	}
	b = d.Backend()
	want := append(fill('a', BlockSize), make([]byte, 2*BlockSize)...)
	if got := mustRead(t, b, 0, 3*BlockSize); !bytes.Equal(got, want) {
		t.Fatalf("after the cut the disk does not read as at the flush")
	}
	if d.Unflushed() != 0 {
		t.Fatalf("unflushed writes left after the cut")
	}
}

func TestDiskFUAIsDurable(t *testing.T) {
	d := newTestDisk(t, 4*BlockSize)
	b := d.Backend()
	b.WriteAt(fill('a', BlockSize), 0, 0)       // lost
	b.WriteAt(fill('b', BlockSize), 0, nbd.FUA) // kept, over a
	b.WriteAt(fill('c', BlockSize), BlockSize, 0)
	b.WriteZeroes(2*BlockSize, BlockSize, nbd.FUA)
	if _, err := d.Cut(LoseAll, nil); err != nil {
		t.Fatal(err)
	}
	got := mustRead(t, d.Backend(), 0, 3*BlockSize)
	if !bytes.Equal(got[:BlockSize], fill('b', BlockSize)) || !bytes.Equal(got[BlockSize:], make([]byte, 2*BlockSize)) {
		t.Fatalf("FUA writes were not kept alone by a cut")
	}
}

// A write or zeroing of part of a block keeps the rest of the block as reads saw it, also
// through a flush and a cut.
func TestDiskPartialBlocks(t *testing.T) {
	d := newTestDisk(t, 4*BlockSize)
	b := d.Backend()
	b.WriteAt(fill('a', 2*BlockSize), 0, 0)
	b.Flush()
	b.WriteAt(fill('b', 512), BlockSize-256, 0) // across blocks 0 and 1
	b.WriteZeroes(100, 50, 0)
	want := fill('a', 2*BlockSize)
	copy(want[BlockSize-256:], fill('b', 512))
	clear(want[100:150])
	if got := mustRead(t, b, 0, 2*BlockSize); !bytes.Equal(got, want) {
		t.Fatalf("partial writes read back wrong")
	}
	if err := b.Flush(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(durable(t, d, 0, 2*BlockSize), want) {
		t.Fatalf("partial writes flushed wrong")
	}
	b.WriteAt(fill('c', 10), 5, 0)
	d.Cut(LoseAll, nil)
	if got := mustRead(t, d.Backend(), 0, 2*BlockSize); !bytes.Equal(got, want) {
		t.Fatalf("a cut did not restore the flushed partial writes")
	}
}

// TestDiskLoseRandom checks LoseRandom's model: after a cut, each block holds a value it
// held since the last flush (the flushed one included), never anything else, and over a
// run some writes are lost, some kept and some torn.
func TestDiskLoseRandom(t *testing.T) {
	const blocks = 64
	var total CutStats
	for seed := uint64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewPCG(seed, 0))
		d := newTestDisk(t, blocks*BlockSize)
		b := d.Backend()
		// held[i]: the hashes block i held since the last flush.
		held := make([]map[[32]byte]bool, blocks)
		zero := sha256.Sum256(make([]byte, BlockSize))
		for i := range held {
			held[i] = map[[32]byte]bool{zero: true}
		}
		img := make([]byte, blocks*BlockSize) // what reads see
		for op := 0; op < 200; op++ {
			switch r := rng.IntN(10); {
			case r == 0:
				if err := b.Flush(); err != nil {
					t.Fatal(err)
				}
				for i := range held {
					held[i] = map[[32]byte]bool{sha256.Sum256(img[i*BlockSize : (i+1)*BlockSize]): true}
				}
			default:
				off := rng.Int64N(blocks*BlockSize - 1)
				n := 1 + rng.Int64N(min(4*BlockSize, blocks*BlockSize-off))
				p := make([]byte, n)
				for i := range p {
					p[i] = byte(rng.Uint32())
				}
				if r == 1 {
					clear(p)
					b.WriteZeroes(off, n, 0)
				} else if err := b.WriteAt(p, off, 0); err != nil {
					t.Fatal(err)
				}
				copy(img[off:], p)
				for i := off / BlockSize; i <= (off+n-1)/BlockSize; i++ {
					held[i][sha256.Sum256(img[i*BlockSize:(i+1)*BlockSize])] = true
				}
			}
		}
		st, err := d.Cut(LoseRandom, rng)
		if err != nil {
			t.Fatal(err)
		}
		total.Lost += st.Lost
		total.Kept += st.Kept
		total.Torn += st.Torn
		after := mustRead(t, d.Backend(), 0, blocks*BlockSize)
		for i := range held {
			if !held[i][sha256.Sum256(after[i*BlockSize:(i+1)*BlockSize])] {
				t.Fatalf("seed %d: block %d holds a value it never held since the last flush", seed, i)
			}
		}
	}
	if total.Lost == 0 || total.Kept == 0 || total.Torn == 0 {
		t.Fatalf("LoseRandom over 20 runs: %+v; want writes lost, kept and torn", total)
	}
}

func TestDiskBadSizes(t *testing.T) {
	dir := t.TempDir()
	for _, size := range []int64{0, -BlockSize, BlockSize + 1} {
		if _, err := CreateDisk(filepath.Join(dir, "x"), size); err == nil {
			t.Errorf("CreateDisk of %d bytes succeeded", size)
		}
	}
	odd := filepath.Join(dir, "odd.img")
	os.WriteFile(odd, make([]byte, 1000), 0o600)
	if _, err := OpenDisk(odd); err == nil {
		t.Errorf("OpenDisk of a 1000-byte image succeeded")
	}
}

// TestDiskOverNBD: a client's FLUSH reaches the Disk, and makes its writes durable.
func TestDiskOverNBD(t *testing.T) {
	d := newTestDisk(t, 64*BlockSize)
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := nbd.ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbd.Server{Exports: []nbd.Export{{Name: "d", Backend: d.Backend()}}}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Shutdown(context.Background()) })
	c, err := nbdclient.Dial("unix", sock, "d")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.WriteAt(fill('a', 8192), 4096, false); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(durable(t, d, 4096, 8192), make([]byte, 8192)) {
		t.Fatalf("a write was durable before a flush")
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if st := d.Stats(); st.Flushes != 1 || st.Writes != 1 {
		t.Fatalf("stats %+v, want one write and one flush", st)
	}
	if !bytes.Equal(durable(t, d, 4096, 8192), fill('a', 8192)) {
		t.Fatalf("a flushed write is not durable")
	}
}

package sysvm

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"syscall"

	"github.com/elidisk/eli/nbd"
)

// BlockSize is the unit a power cut keeps or loses a write in: the page a real disk
// writes atomically.
const BlockSize = 4096

// Disk is a block device with a volatile write cache, as a real disk has: a write is
// held in memory until a flush (or its FUA flag) makes it durable, and a power cut (Cut)
// loses what was not made durable. Durable contents live in a host file, so a Disk can
// be as large as the file system allows and survives any number of boots of the guest.
//
// Killing qemu alone is no power cut: every write it made is in the host's page cache.
// Serving a guest's disk from a Disk over NBD (Export) makes the guest's flushes reach it
// as NBD FLUSH, and Cut then gives the next boot what a disk that lost its power would.
type Disk struct {
	mu   sync.Mutex
	f    *os.File // durable contents
	size int64
	gen  uint64 // bumped by Cut: a Backend of an older generation is refused

	// What was written since the last flush: cur is the newest content of each block
	// (what reads see), log every write in order (what a cut chooses from). A nil
	// block is zeroes.
	cur   map[int64][]byte
	log   []pending
	group uint64 // numbers the writes, which a cut keeps or loses whole

	stats DiskStats
}

// pending is one block of a write not yet made durable.
type pending struct {
	blk   int64
	data  []byte // nil: zeroes
	group uint64 // the write it came from
	fua   bool   // durable at once (FUA): always kept
}

// DiskStats counts what a Disk was asked to do.
type DiskStats struct {
	Writes, Flushes int64 // requests, FUA writes counted as writes
	WrittenBytes    int64
	Cuts            int64
}

// CutMode is what a power cut keeps of the writes that were not flushed.
type CutMode int

const (
	// LoseAll loses every write that was not flushed: the harshest cache.
	LoseAll CutMode = iota
	// LoseRandom loses each unflushed write whole, keeps it whole, or tears it (each
	// 4 KiB block kept or lost on its own), chosen at random for each write, as
	// blockdev's crash test does to eli's provider. Later writes to a block are kept or
	// lost independently of earlier ones, so a block ends up with any value it held
	// since the last flush.
	LoseRandom
)

func (m CutMode) String() string {
	switch m {
	case LoseAll:
		return "lose-all"
	case LoseRandom:
		return "lose-random"
	}
	return fmt.Sprintf("CutMode(%d)", int(m))
}

// CutStats says what a cut did to the writes it found unflushed.
type CutStats struct {
	Writes      int // unflushed writes (FUA writes not counted)
	Lost, Kept  int // writes lost or kept whole
	Torn        int // writes of which some blocks were kept and others lost
	LostBlocks  int // 4 KiB blocks that did not reach the durable contents
	TotalBlocks int // 4 KiB blocks of those writes
}

// CreateDisk makes a zeroed disk of size bytes (a multiple of BlockSize) in a new file
// at path.
func CreateDisk(path string, size int64) (*Disk, error) {
	if size <= 0 || size%BlockSize != 0 {
		return nil, fmt.Errorf("sysvm: disk size %d is not a positive multiple of %d", size, BlockSize)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("sysvm: create disk: %w", err)
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("sysvm: create disk: %w", err)
	}
	return newDisk(f, size), nil
}

// OpenDisk serves the file at path (an image whose size is a multiple of BlockSize) as
// a Disk; the file holds its durable contents from then on.
func OpenDisk(path string) (*Disk, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("sysvm: open disk: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("sysvm: open disk: %w", err)
	}
	if st.Size() <= 0 || st.Size()%BlockSize != 0 {
		f.Close()
		return nil, fmt.Errorf("sysvm: disk image %s is %d bytes, not a positive multiple of %d", path, st.Size(), BlockSize)
	}
	return newDisk(f, st.Size()), nil
}

func newDisk(f *os.File, size int64) *Disk {
	return &Disk{f: f, size: size, cur: map[int64][]byte{}}
}

// Close closes the file of durable contents; unflushed writes are dropped.
func (d *Disk) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.gen++
	d.cur, d.log = map[int64][]byte{}, nil
	return d.f.Close()
}

// Path is the file of durable contents.
func (d *Disk) Path() string { return d.f.Name() }

// Size is the disk's size in bytes.
func (d *Disk) Size() int64 { return d.size }

// Stats returns the counters.
func (d *Disk) Stats() DiskStats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.stats
}

// Unflushed is the number of 4 KiB block writes that a cut could lose (FUA ones aside;
// a block written twice counts twice).
func (d *Disk) Unflushed() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.unflushedLocked()
}

func (d *Disk) unflushedLocked() int {
	n := 0
	for _, p := range d.log {
		if !p.fua {
			n++
		}
	}
	return n
}

// Flush makes every write so far durable, as an NBD FLUSH does.
func (d *Disk) Flush() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.flushLocked()
}

func (d *Disk) flushLocked() error {
	for blk, data := range d.cur {
		if err := d.writeDurable(blk, data); err != nil {
			return err
		}
	}
	d.cur, d.log = map[int64][]byte{}, nil
	return nil
}

var zeroBlock = make([]byte, BlockSize)

func (d *Disk) writeDurable(blk int64, data []byte) error {
	if data == nil {
		data = zeroBlock
	}
	if _, err := d.f.WriteAt(data, blk*BlockSize); err != nil {
		return fmt.Errorf("sysvm: disk %s: %w", d.f.Name(), err)
	}
	return nil
}

// Cut is a power cut: the writes not flushed are lost, kept or torn as mode says (rng
// chooses for LoseRandom; it may be nil for LoseAll), and every Backend handed out so
// far fails from now on, so that a request of the old machine still in flight cannot
// land on the next boot's disk.
func (d *Disk) Cut(mode CutMode, rng *rand.Rand) (CutStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cutLocked(mode, rng)
}

func (d *Disk) cutLocked(mode CutMode, rng *rand.Rand) (CutStats, error) {
	if mode == LoseRandom && rng == nil {
		return CutStats{}, errors.New("sysvm: LoseRandom needs a random source")
	}
	d.gen++
	d.stats.Cuts++
	var st CutStats
	// A write's blocks are contiguous in the log: decide once per write.
	for i := 0; i < len(d.log); {
		j := i
		for j < len(d.log) && d.log[j].group == d.log[i].group {
			j++
		}
		w := d.log[i:j]
		i = j
		if w[0].fua {
			for _, p := range w {
				if err := d.writeDurable(p.blk, p.data); err != nil {
					return st, err
				}
			}
			continue
		}
		st.Writes++
		st.TotalBlocks += len(w)
		choice := 0 // lost
		if mode == LoseRandom {
			choice = rng.IntN(3)
		}
		kept := 0
		for _, p := range w {
			keep := choice == 1 || choice == 2 && rng.IntN(2) == 0
			if !keep {
				continue
			}
			kept++
			if err := d.writeDurable(p.blk, p.data); err != nil {
				return st, err
			}
		}
		st.LostBlocks += len(w) - kept
		switch {
		case kept == 0:
			st.Lost++
		case kept == len(w):
			st.Kept++
		default:
			st.Torn++
		}
	}
	d.cur, d.log = map[int64][]byte{}, nil
	return st, nil
}

// errStale refuses a request of a machine whose power was cut.
var errStale = fmt.Errorf("sysvm: request from before a power cut: %w", syscall.EIO)

// readBlockLocked is block blk as reads see it.
func (d *Disk) readBlockLocked(blk int64, p []byte) error {
	if data, ok := d.cur[blk]; ok {
		if data == nil {
			clear(p)
		} else {
			copy(p, data)
		}
		return nil
	}
	if _, err := d.f.ReadAt(p, blk*BlockSize); err != nil {
		return fmt.Errorf("sysvm: disk %s: %w", d.f.Name(), err)
	}
	return nil
}

func (d *Disk) checkRange(off, n int64) error {
	if off < 0 || n < 0 || off+n > d.size {
		return fmt.Errorf("sysvm: [%d, %d) outside the %d-byte disk: %w", off, off+n, d.size, syscall.EINVAL)
	}
	return nil
}

func (d *Disk) readAt(gen uint64, p []byte, off int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if gen != d.gen {
		return errStale
	}
	if err := d.checkRange(off, int64(len(p))); err != nil {
		return err
	}
	var buf [BlockSize]byte
	for len(p) > 0 {
		blk, in := off/BlockSize, off%BlockSize
		n := min(int64(len(p)), BlockSize-in)
		if _, ok := d.cur[blk]; !ok {
			// Runs of blocks that only the durable file holds are read in one call.
			end := blk + 1
			for end*BlockSize < off+int64(len(p)) {
				if _, ok := d.cur[end]; ok {
					break
				}
				end++
			}
			n = min(int64(len(p)), end*BlockSize-off)
			if _, err := d.f.ReadAt(p[:n], off); err != nil {
				return fmt.Errorf("sysvm: disk %s: %w", d.f.Name(), err)
			}
		} else if err := d.readBlockLocked(blk, buf[:]); err != nil {
			return err
		} else {
			copy(p[:n], buf[in:])
		}
		p, off = p[n:], off+n
	}
	return nil
}

// write stores [off, off+n) as one write: p's bytes, or zeroes when p is nil.
func (d *Disk) write(gen uint64, p []byte, off, n int64, fua bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if gen != d.gen {
		return errStale
	}
	if err := d.checkRange(off, n); err != nil {
		return err
	}
	d.group++
	d.stats.Writes++
	d.stats.WrittenBytes += n
	for n > 0 {
		blk, in := off/BlockSize, off%BlockSize
		m := min(n, BlockSize-in)
		var data []byte
		switch {
		case m == BlockSize && p == nil:
			// zeroes
		case m == BlockSize:
			data = append([]byte(nil), p[:m]...)
		default:
			// Part of a block: the rest keeps what reads see now.
			data = make([]byte, BlockSize)
			if err := d.readBlockLocked(blk, data); err != nil {
				return err
			}
			if p == nil {
				clear(data[in : in+m])
			} else {
				copy(data[in:], p[:m])
			}
		}
		d.cur[blk] = data
		d.log = append(d.log, pending{blk: blk, data: data, group: d.group, fua: fua})
		if p != nil {
			p = p[m:]
		}
		off, n = off+m, n-m
	}
	return nil
}

// Backend is the disk as an NBD export serves it, until the next Cut.
func (d *Disk) Backend() nbd.Backend {
	d.mu.Lock()
	defer d.mu.Unlock()
	return &backend{d: d, gen: d.gen}
}

type backend struct {
	d   *Disk
	gen uint64
}

func (b *backend) Size() int64                      { return b.d.size }
func (b *backend) ReadAt(p []byte, off int64) error { return b.d.readAt(b.gen, p, off) }

func (b *backend) WriteAt(p []byte, off int64, flags nbd.Flags) error {
	return b.d.write(b.gen, p, off, int64(len(p)), flags&nbd.FUA != 0)
}

func (b *backend) WriteZeroes(off, length int64, flags nbd.Flags) error {
	return b.d.write(b.gen, nil, off, length, flags&nbd.FUA != 0)
}

// Trim does nothing: a trimmed range may read as anything, its old contents included,
// and keeping them keeps a trim of the whole disk (mkfs) from costing memory.
func (b *backend) Trim(off, length int64, flags nbd.Flags) error {
	b.d.mu.Lock()
	defer b.d.mu.Unlock()
	if b.gen != b.d.gen {
		return errStale
	}
	return nil
}

func (b *backend) Flush() error {
	b.d.mu.Lock()
	defer b.d.mu.Unlock()
	if b.gen != b.d.gen {
		return errStale
	}
	b.d.stats.Flushes++
	return b.d.flushLocked()
}

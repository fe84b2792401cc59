// Package provider opens the storage that holds an eli volume: a regular file or a block
// device. It hides the differences (size, sync, punching holes, locking) behind Provider,
// the small interface keys/ and blockdev/ do their I/O through, so tests can put a
// crash-recording or fault-injecting wrapper in its place.
package provider

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// Provider is random-access storage with a durable barrier.
type Provider interface {
	io.ReaderAt
	io.WriterAt
	// Sync makes every completed WriteAt (and Punch) durable.
	Sync() error
	// Size is the provider's size in bytes.
	Size() int64
}

// Capabilities are what a provider can do beyond Provider, which its user plans by:
// whether to punch or write zeroes, whether to write from one thread or several, whether
// to go through a mapping. A provider states them all at once (Capable); its user asks
// once, when it opens the provider (CapabilitiesOf), and keeps the answer, so that no
// question is asked per request. A zero field means no (AtomicWrite: unknown), a nil
// function that the provider has no such operation.
type Capabilities struct {
	// SerialWrites: concurrent WriteAt calls run one after the other anyway, so that a
	// caller with several writes to make does better to issue them from one thread: a
	// second writer only waits, and may spin while it waits.
	SerialWrites bool
	// AtomicWrite is the size in bytes of an aligned write that a crash leaves either
	// wholly old or wholly new; 0 if the provider cannot say.
	AtomicWrite int
	// Shared: hosts other than this one may write the storage while it is attached (a
	// shared LUN, a network export), so a lock taken on this host does not keep every
	// other writer out.
	Shared bool
	// BlockDevice: the storage is a block device rather than a file: punching zeroes
	// the range instead of freeing it, and the size is fixed.
	BlockDevice bool

	// Punch drops [off, off+length) cheaply, so that it reads as zeroes (a hole in a
	// file, a zeroed or discarded range on a device).
	Punch func(off, length int64) error
	// WriteMapped writes b at off by copying it into memory shared with the storage (a
	// mapped file on tmpfs), without a system call; ok false means it did not (no
	// writable mapping, or the range lies outside it), and the caller uses WriteAt. The
	// price: a process killed during the copy leaves the range torn at any byte, not
	// page by page, so callers use it only for writes that their recovery accepts torn.
	WriteMapped func(b []byte, off int64) (ok bool, err error)
	// ReadOnce reads with a system call where ReadAt may go through a mapping (a file
	// on tmpfs): for bytes that the caller reads once and keeps, such as metadata loaded
	// into a cache. A first read of a page through a mapping faults it in, and with
	// fault-around its neighbours too, which costs far more than pread where page-table
	// updates are dear (a VM: docs/benchmarks.md, "Measurements behind design choices");
	// the mapping pays off only for pages read again and again.
	ReadOnce func(b []byte, off int64) (int, error)
}

// Capable is implemented by providers that can do more than Provider. A wrapper that
// stands in for another provider states its own: what it passes on of the wrapped
// one's, through its own methods where it watches or changes them.
type Capable interface {
	Capabilities() Capabilities
}

// CapabilitiesOf is p's Capabilities, or none if p is not Capable.
func CapabilitiesOf(p Provider) Capabilities {
	if c, ok := p.(Capable); ok {
		return c.Capabilities()
	}
	return Capabilities{}
}

// ErrInUse is returned by Lock when another process holds the provider.
var ErrInUse = errors.New("provider is in use (attached by another eli process?)")

// File is a Provider backed by a regular file or a block device.
type File struct {
	f       *os.File
	path    string
	size    int64
	isBlock bool
	atomic  int    // Capabilities.AtomicWrite
	mem     []byte // the whole file mapped for reading, or nil (mapped.go)
	// wmem: the whole file mapped again, for writing (WriteMapped), or nil.
	wmem     []byte
	resident []atomic.Uint64 // a bit per residentRegion of mem known in memory (mapped.go)
	seen     []atomic.Uint64 // a bit per seenChunk of mem read before (firstread.go)
	first    firstWay        // how a chunk's first read goes (firstread.go)
	probes   atomic.Uint64   // reads that asked mincore, to probe whole regions now and then
	walked   atomic.Bool     // markAllocated has run (or is running) since the file was mapped
	punches  atomic.Uint64   // punches begun, so that a probe does not outlive one
	raw      *rawFile        // on tmpfs: raw pread, pwrite and fdatasync (rawio.go); nil elsewhere
}

// Open opens path for reading, and for writing unless readOnly. It does not lock.
func Open(path string, readOnly bool) (*File, error) {
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(path, flag|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open provider: %w", err)
	}
	p := &File{f: f, path: path}
	if err := p.refreshSize(); err != nil {
		f.Close()
		return nil, err
	}
	p.mapIfTmpfs()
	return p, nil
}

// FromFile wraps an already open file (e.g. a descriptor inherited from the process that
// opened and locked it); path is only for messages.
func FromFile(f *os.File, path string) (*File, error) {
	p := &File{f: f, path: path}
	if err := p.refreshSize(); err != nil {
		return nil, err
	}
	p.mapIfTmpfs()
	return p, nil
}

// File returns the underlying file, e.g. to pass it to a child process.
func (p *File) File() *os.File { return p.f }

func (p *File) refreshSize() error {
	st, err := p.f.Stat()
	if err != nil {
		return fmt.Errorf("stat provider %s: %w", p.path, err)
	}
	switch {
	case st.Mode().IsRegular():
		p.size = st.Size()
	case st.Mode()&os.ModeDevice != 0 && st.Mode()&os.ModeCharDevice == 0:
		n, err := unix.IoctlGetUint64(int(p.f.Fd()), unix.BLKGETSIZE64)
		if err != nil {
			return fmt.Errorf("size of block device %s: %w", p.path, err)
		}
		bs, err := unix.IoctlGetInt(int(p.f.Fd()), unix.BLKSSZGET)
		if err != nil {
			return fmt.Errorf("block size of block device %s: %w", p.path, err)
		}
		p.size, p.isBlock, p.atomic = int64(n), true, bs
	case st.IsDir():
		return fmt.Errorf("provider %s is a directory: give a file or a block device", p.path)
	default:
		return fmt.Errorf("provider %s is neither a regular file nor a block device", p.path)
	}
	return nil
}

// Path is the name the provider was opened by.
func (p *File) Path() string { return p.path }

// Fd exposes the descriptor, for identity checks (fstat) by callers.
func (p *File) Fd() uintptr { return p.f.Fd() }

// IsBlockDevice reports whether the provider is a block device rather than a file.
func (p *File) IsBlockDevice() bool { return p.isBlock }

func (p *File) Size() int64 { return p.size }

// Capabilities: a regular file's writes are serial (Linux file systems take the inode's
// lock exclusively for a buffered write: tmpfs, ext4, XFS and btrfs all do, so two
// pwrites to one file run one after the other, and the second spins on the lock
// meanwhile: more CPU per byte for no gain in throughput), while a block device's page
// cache takes no such lock, and parallel writes to it run faster than one thread's
// (docs/benchmarks.md, "Measurements behind design choices"). A block device's atomic
// write is its logical block size, the unit its writes complete in; a regular file's is
// unknown: what a crash leaves of a write depends on the file system and on the crash
// (a killed process leaves each page old or new, a power cut whatever the file system's
// journaling mode leaves). Both punch, and read and write through a mapping where they
// have one (mapped.go).
func (p *File) Capabilities() Capabilities {
	return Capabilities{
		SerialWrites: !p.isBlock,
		AtomicWrite:  p.atomic,
		BlockDevice:  p.isBlock,
		Punch:        p.Punch,
		WriteMapped:  p.WriteMapped,
		ReadOnce:     p.ReadOnce,
	}
}

func (p *File) ReadAt(b []byte, off int64) (int, error) {
	if n, ok, err := p.readMapped(b, off); ok {
		return n, err
	}
	return p.ReadOnce(b, off)
}

// ReadOnce is pread, also where the file is mapped (Capabilities.ReadOnce).
func (p *File) ReadOnce(b []byte, off int64) (int, error) {
	if p.raw != nil {
		return p.raw.ReadAt(b, off)
	}
	return p.f.ReadAt(b, off)
}

// WriteAt is pwrite, also where the file is mapped: see mapped.go for why (and
// rawio.go for why a raw one on tmpfs).
func (p *File) WriteAt(b []byte, off int64) (int, error) {
	if p.raw != nil {
		return p.raw.WriteAt(b, off)
	}
	return p.f.WriteAt(b, off)
}

// Sync uses fdatasync: eli never depends on file metadata other than the size, which
// Extend syncs itself.
func (p *File) Sync() error {
	if p.raw != nil {
		if err := p.raw.Sync(); err != nil {
			return fmt.Errorf("sync provider: %w", err)
		}
		return nil
	}
	for {
		err := unix.Fdatasync(int(p.f.Fd()))
		if err != unix.EINTR {
			if err != nil {
				return fmt.Errorf("sync provider: %w", err)
			}
			return nil
		}
	}
}

// Punch makes [off, off+length) read as zeroes without writing them where the provider
// allows it: a hole in a file, BLKZEROOUT on a block device (which the device may offload).
func (p *File) Punch(off, length int64) error {
	if length <= 0 {
		return nil
	}
	fd := int(p.f.Fd())
	p.forgetResident(off, length)
	if p.isBlock {
		r := [2]uint64{uint64(off), uint64(length)}
		if err := ioctlPtr(fd, unix.BLKZEROOUT, &r); err != nil {
			return fmt.Errorf("zero range on %s: %w", p.path, err)
		}
		return nil
	}
	err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, length)
	if err == unix.EOPNOTSUPP || err == unix.ENOSYS {
		return writeZeroes(p.f, off, length)
	}
	if err != nil {
		return fmt.Errorf("punch hole in %s: %w", p.path, err)
	}
	return nil
}

// writeZeroes is Punch's fallback on filesystems without hole punching.
func writeZeroes(w io.WriterAt, off, length int64) error {
	zero := make([]byte, min(length, 1<<20))
	for length > 0 {
		n := min(length, int64(len(zero)))
		if _, err := w.WriteAt(zero[:n], off); err != nil {
			return err
		}
		off += n
		length -= n
	}
	return nil
}

// Extend grows a regular file to size bytes (sparse) and syncs the new size. It refuses
// to shrink and is an error on block devices.
func (p *File) Extend(size int64) error {
	if p.isBlock {
		return fmt.Errorf("cannot resize block device %s from eli: grow the device itself", p.path)
	}
	if size < p.size {
		return fmt.Errorf("refusing to shrink %s from %d to %d bytes", p.path, p.size, size)
	}
	if size == p.size {
		return nil
	}
	if err := p.unmap(); err != nil {
		return err
	}
	if err := p.f.Truncate(size); err != nil {
		return fmt.Errorf("extend %s: %w", p.path, err)
	}
	if err := p.f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", p.path, err)
	}
	if err := p.refreshSize(); err != nil {
		return err
	}
	p.mapIfTmpfs()
	return nil
}

// Lock takes an exclusive advisory lock on the provider for as long as it stays open.
// It fails at once with ErrInUse if another open file description holds it.
func (p *File) Lock() error { return p.flock(unix.LOCK_EX) }

// LockShared takes a shared advisory lock, for a reader that must not run beside a
// writer: any number of readers hold it together, and it fails at once with ErrInUse
// while a writer holds Lock (and Lock fails while a reader holds this).
func (p *File) LockShared() error { return p.flock(unix.LOCK_SH) }

func (p *File) flock(how int) error {
	err := unix.Flock(int(p.f.Fd()), how|unix.LOCK_NB)
	if err == unix.EWOULDBLOCK {
		return fmt.Errorf("%s: %w", p.path, ErrInUse)
	}
	if err != nil {
		return fmt.Errorf("lock %s: %w", p.path, err)
	}
	return nil
}

// Close releases the mapping, the lock (if held) and the descriptor.
func (p *File) Close() error {
	err := p.unmap()
	if cerr := p.f.Close(); err == nil {
		err = cerr
	}
	return err
}

package provider

import (
	"fmt"
	"os"
	"runtime/debug"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A regular file on tmpfs is read through a shared, read-only mapping of the whole file
// instead of pread (its first reads perhaps not: below). On tmpfs, pread is mostly
// per-page bookkeeping (look up and reference each 4 KiB folio, copy, release), several
// times the CPU of a copy out of the same pages mapped, and a large part of an encrypted
// read's CPU time (docs/benchmarks.md, "Measurements behind design choices"). The copy
// still goes into the caller's buffer, so that what blockdev authenticates and what it
// decrypts are the same bytes, whatever another process does to the file meanwhile.
// What a caller reads once and keeps (blockdev's metadata blocks and tree nodes) it
// reads with ReadOnce, which is pread: a first touch of a page through the mapping
// faults it in, with its neighbours, and that can cost more than the system call.
//
// Only where all pages of the range are in memory (mincore): a read fault on a hole of a
// tmpfs file allocates a page, which would fill a sparse provider with zeroes, so holes
// are left to pread. (A hole punched between mincore and the copy gets a page of zeroes:
// the same bytes, a page of memory spent.) The mapping costs no memory of its own beyond
// page tables for the pages read through it: 2 MiB per GiB read, with 4 KiB pages.
//
// mincore is a system call, a good part of a random 4 KiB read's cost on a VM, so the
// answer is remembered for whole regions of residentRegion bytes: a region found with
// every page in memory is read without asking again, until Punch makes holes in it. A
// region is probed whole now and then while reads of it find their own pages in memory
// (1 in probeEvery), so that a sparse region, whose probe costs a page-cache lookup per
// hole, is not probed on every read. Pages that tmpfs swaps out stay "resident" for this
// purpose: a read faults them back in, and allocates nothing.
//
// Data writes stay pwrite. A copy into the mapping costs much less CPU than pwrite, but
// a process killed in the middle of a memory copy leaves the range torn at any byte,
// where pwrite, page by page from memory it holds, leaves each page old or new; and the
// crash guarantee needs every sector old or new after a crash (docs/threat-model.md).
// WriteMapped offers the copy to callers whose writes recovery accepts torn at any byte:
// blockdev's journal, metadata blocks and tree nodes, which the journal or its seal
// accounts for (docs/format.md, "Journal"). Such a write into a hole allocates its page
// as pwrite would; where tmpfs is full that is a fault, an error like pwrite's ENOSPC.
//
// Those writes go through a second, writable mapping of the file, and reads keep to the
// read-only one: first reads of pages through a writable shared mapping cost several
// times the CPU of reads through a read-only one, and a server's first read of a volume
// much more in all (measured on a VM, docs/benchmarks.md, "Measurements behind design
// choices"; why, we did not pin down).
//
// A first touch of a page through the mapping faults it in: the kernel sets up its
// page-table entries, which later copies out of the same pages do not pay. Where page
// tables are cheap to change, that costs less than pread's bookkeeping; where they are
// dear (a VM whose hypervisor shadows the guest's page tables) it costs several times
// pread, and then the data a fresh server meets first, read once (a boot, a scan, a
// backup, a copy), is far cheaper to read by pread. So the first read of each 64 KiB
// chunk goes one way or the other as the machine's own costs decide, measured on the
// file's first reads (firstread.go); chunks read before always go through the mapping.
//
// On file systems backed by a disk nothing is mapped: pread costs much less there than
// on tmpfs, a mapping would only add page tables, and a write through it would reach
// the disk only by msync.
//
// A fault in the mapping (the file truncated by another process) is SIGBUS; with
// SetPanicOnFault it becomes a panic that ReadAt turns into an error for that read, as
// pread would return EIO or a short read.

// mapIfTmpfs maps the file if it is a non-empty regular file on tmpfs: for reading, and a
// second time for writing if the file is open for writing. Such a file's reads, writes
// and syncs that are not copies through the mapping are raw system calls (rawio.go). Where that does not apply, or
// mapping fails, the file keeps to pread and pwrite: the mapping is only ever a faster
// way to the same bytes.
func (p *File) mapIfTmpfs() {
	var st unix.Statfs_t
	fd := int(p.f.Fd())
	if p.isBlock || p.size <= 0 || int64(int(p.size)) != p.size || unix.Fstatfs(fd, &st) != nil || st.Type != unix.TMPFS_MAGIC {
		return
	}
	if p.raw == nil {
		if rc, err := p.f.SyscallConn(); err == nil {
			p.raw = newRawFile(rc, p.path)
		}
	}
	mem, err := unix.Mmap(fd, 0, int(p.size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return
	}
	p.mem = mem
	p.resident = make([]atomic.Uint64, (p.size+residentRegion*64-1)/(residentRegion*64))
	p.seen = make([]atomic.Uint64, (p.size+seenChunk*64-1)/(seenChunk*64))
	if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0); err == nil && fl&unix.O_ACCMODE == unix.O_RDWR {
		if wmem, err := unix.Mmap(fd, 0, int(p.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
			p.wmem = wmem
		}
	}
}

const (
	// residentRegion is the unit in which readMapped remembers that every page is in
	// memory: 2 MiB, 64 KiB of bits per TiB mapped.
	residentRegion = 2 << 20
	// probeEvery: one read in probeEvery of a region not known to be resident probes the
	// whole region.
	probeEvery = 64
	// walkExtents bounds markAllocated's system calls, two per extent.
	walkExtents = 1024
)

// isResident reports whether every region that [off, off+n) touches is known resident.
func (p *File) isResident(off, n int64) bool {
	for r := off / residentRegion; r <= (off+n-1)/residentRegion; r++ {
		if p.resident[r/64].Load()&(1<<(r%64)) == 0 {
			return false
		}
	}
	return true
}

// forgetResident clears the regions that [off, off+n) touches, before a punch.
func (p *File) forgetResident(off, n int64) {
	if p.mem == nil || n <= 0 {
		return
	}
	p.punches.Add(1) // before the bits: see probeRegion
	end := min(off+n, int64(len(p.mem)))
	for r := off / residentRegion; r < (end+residentRegion-1)/residentRegion; r++ {
		p.resident[r/64].And(^(uint64(1) << (r % 64)))
	}
}

// markAllocated marks resident every region that lies wholly within the file's data, as
// lseek's SEEK_DATA and SEEK_HOLE find it, before the first read that would ask mincore.
// On tmpfs those walk the page cache once from one end of the file to the other, a
// fraction of what mincore of the same pages costs while they are not mapped (per read,
// or per region probed); a sequential first pass over a provider written whole then asks
// mincore nothing, and a random one does not wait for probes. A file in more than
// walkExtents pieces of data is left to mincore after the first ones, so that the walk
// stays bounded. Pages that tmpfs holds but has not had written (fallocate) count as
// holes here, where mincore finds them in memory: their regions are left to mincore.
// BenchmarkFreshReads measures it (docs/benchmarks.md, "A fresh server").
func (p *File) markAllocated() {
	fd := int(p.f.Fd())
	punches := p.punches.Load() // before the walk: see probeRegion
	for off, n := int64(0), 0; off < p.size && n < walkExtents; n++ {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil { // ENXIO: no data after off
			break
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			break
		}
		from, to := (data+residentRegion-1)/residentRegion, hole/residentRegion
		if hole >= p.size {
			to = (p.size + residentRegion - 1) / residentRegion // the last region ends at the end
		}
		for r := from; r < to; r++ {
			p.resident[r/64].Or(1 << (r % 64))
		}
		off = hole
	}
	if p.punches.Load() != punches {
		// A punch may have cleared a bit before the walk set it: forget them all, and
		// let probes find them again.
		for i := range p.resident {
			p.resident[i].Store(0)
		}
	}
}

// probeRegion asks mincore whether every page of region r is in memory, and remembers it
// if so.
func (p *File) probeRegion(r int64) {
	start := r * residentRegion
	span := p.mem[start:min(start+residentRegion, int64(len(p.mem)))]
	var vec [residentRegion / 4096]byte
	pages := (int64(len(span)) + pageSize - 1) / pageSize
	if pages > int64(len(vec)) {
		return // pages smaller than 4 KiB: leave it to per-read checks
	}
	punches := p.punches.Load()
	if !allInMemory(span, vec[:pages]) {
		return
	}
	p.resident[r/64].Or(1 << (r % 64))
	// A punch since the probe may have cleared the bit before it was set: take it back.
	if p.punches.Load() != punches {
		p.resident[r/64].And(^(uint64(1) << (r % 64)))
	}
}

// allInMemory calls mincore on span (page-aligned), one byte of vec per page.
func allInMemory(span, vec []byte) bool {
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&span[0])), uintptr(len(span)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return false
	}
	for _, v := range vec {
		if v&1 == 0 {
			return false
		}
	}
	return true
}

// Mapped reports whether reads go through a mapping of the file.
func (p *File) Mapped() bool { return p.mem != nil }

// unmap drops the mapping; reads go back to pread.
func (p *File) unmap() error {
	if p.mem == nil {
		return nil
	}
	mem, wmem := p.mem, p.wmem
	p.mem, p.wmem, p.resident, p.seen = nil, nil, nil, nil
	p.walked.Store(false)
	err := unix.Munmap(mem)
	if wmem != nil {
		if werr := unix.Munmap(wmem); err == nil {
			err = werr
		}
	}
	if err != nil {
		return fmt.Errorf("unmap %s: %w", p.path, err)
	}
	return nil
}

var pageSize = int64(os.Getpagesize())

// readMapped copies from the mapping at off into b if the range lies within the mapping
// and all its pages are in memory; ok false leaves the read to pread.
func (p *File) readMapped(b []byte, off int64) (n int, ok bool, err error) {
	if p.mem == nil || len(b) == 0 || off < 0 || off > int64(len(p.mem))-int64(len(b)) {
		return 0, false, nil
	}
	way, whole := p.first.way.Load(), false
	if way != wayMap {
		var fresh bool
		fresh, whole = p.firstRead(off, int64(len(b)))
		if fresh && way == wayPread {
			return 0, false, nil
		}
	}
	if !p.isResident(off, int64(len(b))) && p.walked.CompareAndSwap(false, true) {
		p.markAllocated()
	}
	if !p.isResident(off, int64(len(b))) {
		start := off &^ (pageSize - 1) // mincore wants it page-aligned
		span := p.mem[start : off+int64(len(b))]
		var small [64]byte // one byte per page: 256 KiB
		vec := small[:]
		if pages := (int64(len(span)) + pageSize - 1) / pageSize; pages <= int64(len(small)) {
			vec = small[:pages]
		} else {
			vec = make([]byte, pages)
		}
		if !allInMemory(span, vec) {
			return 0, false, nil
		}
		if p.probes.Add(1)%probeEvery == 0 {
			p.probeRegion(off / residentRegion)
		}
	}
	if whole && way == wayUndecided {
		return p.firstReadSample(b, off)
	}
	n, err = p.copyMapped(b, off)
	return n, true, err
}

// copyMapped copies the mapping at off into b, which the caller has checked lies within
// it. A fault there is returned as an error; any other panic goes on.
func (p *File) copyMapped(b []byte, off int64) (n int, err error) {
	return p.guardFault("read", off, func() int { return copy(b, p.mem[off:]) })
}

// WriteMapped copies b into the mapping at off, without a system call, if the file is
// mapped for writing and the range lies within the mapping; ok false leaves the write to
// WriteAt. A process killed during the copy leaves the range torn at any byte (see
// above): only for writes that recovery accepts torn.
func (p *File) WriteMapped(b []byte, off int64) (ok bool, err error) {
	if p.wmem == nil || off < 0 || off > int64(len(p.wmem))-int64(len(b)) {
		return false, nil
	}
	n, err := p.guardFault("write", off, func() int { return copy(p.wmem[off:], b) })
	if err == nil && n != len(b) {
		err = fmt.Errorf("write %s at offset %d: short copy into the mapping", p.path, off)
	}
	return true, err
}

// guardFault runs a copy from or into the mapping; a fault in the mapping (the file
// truncated by another process, or tmpfs full under a write into a hole) is returned as
// an error, any other panic goes on.
func (p *File) guardFault(op string, off int64, copyFn func() int) (n int, err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if r := recover(); r != nil {
			fault, isFault := r.(interface{ Addr() uintptr })
			if !isFault || !p.inMapping(fault.Addr()) {
				panic(r)
			}
			n, err = 0, fmt.Errorf("%s %s at offset %d: the mapped file faulted (truncated by another process, or the file system full?)", op, p.path, off)
		}
	}()
	return copyFn(), nil
}

// inMapping reports whether addr lies in one of the mappings.
func (p *File) inMapping(addr uintptr) bool {
	in := func(m []byte) bool {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(m)))
		return m != nil && addr >= base && addr-base < uintptr(len(m))
	}
	return in(p.mem) || in(p.wmem)
}

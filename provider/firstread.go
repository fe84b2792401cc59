package provider

import (
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// How a mapped file reads a chunk for the first time (mapped.go): through the mapping,
// faulting its pages in, or by pread, leaving the mapping to the chunk's later reads.
// What a first touch through the mapping costs differs by an order of magnitude between
// machines, against a pread that costs about the same everywhere: on a VM whose
// hypervisor shadows the guest's page tables the faults cost several times pread, on
// one with nested paging less than pread (docs/benchmarks.md, "A fresh server";
// BenchmarkFreshReads measures both ways). So the file measures both on its own first
// reads: the first whole reads of new chunks (no part of them read before, at least
// seenChunk long) alternate between the mapping and pread, each timed in the CPU time
// of its thread, until each way has read firstSampleBytes. Until then, first reads
// that are not samples go through the mapping.
//
// pread wins if the mapping's first touch costs more than firstPreadFactor times as
// much per byte. With M the cost of a first read through the mapping, P a pread's and
// C a copy out of pages already mapped (less than P: why the mapping is there), reading
// a chunk first by pread saves M − P on a chunk read once, and costs P − C on a chunk
// read again, which then pays the faults as well; M > 2P makes the first larger than
// the second whatever C is.
const (
	// seenChunk is the unit in which a file remembers what was read before: the 64 KiB
	// that one read fault maps (fault-around) and the smallest piece in which blockdev
	// reads a sequential run, so that a sequential pass finds its chunks new. A bit
	// each: 2 KiB per GiB mapped.
	seenChunk        = 64 << 10
	firstSampleBytes = 1 << 20
	firstPreadFactor = 2
)

const (
	wayUndecided int32 = iota // sampling: first reads through the mapping, some by pread
	wayMap                    // first reads through the mapping
	wayPread                  // first reads by pread
)

// firstWay is a file's choice for first reads, and the samples it is made from.
type firstWay struct {
	way   atomic.Int32
	turn  atomic.Uint32   // which way the next sample goes
	ns    [2]atomic.Int64 // CPU time of the samples: [0] through the mapping, [1] by pread
	bytes [2]atomic.Int64 // bytes they read (the mapping's: whole chunks, as it maps them)
}

// firstRead marks the chunks that [off, off+n) touches as read. fresh reports whether
// any of them was not read before, whole whether none was and the range is at least a
// chunk long: a sample of what a first read costs. Two reads that race may both find a
// chunk new: one more pread, or one more sample.
func (p *File) firstRead(off, n int64) (fresh, whole bool) {
	seen := false
	for c := off / seenChunk; c <= (off+n-1)/seenChunk; c++ {
		w, bit := &p.seen[c/64], uint64(1)<<(c%64)
		if w.Load()&bit != 0 {
			seen = true
			continue
		}
		w.Or(bit)
		fresh = true
	}
	return fresh, !seen && n >= seenChunk
}

// firstReadSample reads b at off, which lies within the mapping, with every page in
// memory and no chunk of it read before, through the mapping or by pread, whichever
// this sample measures, and decides the file's way once both have read enough.
func (p *File) firstReadSample(b []byte, off int64) (n int, ok bool, err error) {
	way := int(p.first.turn.Add(1) % 2)
	// Both readings of the thread's clock must come from the same thread.
	runtime.LockOSThread()
	start := threadCPU()
	if way == 0 {
		n, err = p.copyMapped(b, off)
	} else {
		n, err = p.ReadOnce(b, off)
	}
	end := threadCPU()
	runtime.UnlockOSThread()
	if err != nil || start < 0 || end < start {
		return n, true, err
	}
	bytes := int64(len(b))
	if way == 0 { // the faults map whole chunks
		bytes = ((off+bytes-1)/seenChunk - off/seenChunk + 1) * seenChunk
	}
	p.first.ns[way].Add(end - start)
	p.first.bytes[way].Add(bytes)
	if w := p.first.decide(); w != wayUndecided {
		p.first.way.CompareAndSwap(wayUndecided, w)
	}
	return n, true, nil
}

// decide returns the way the samples so far choose, or wayUndecided while either way
// has read less than firstSampleBytes.
func (f *firstWay) decide() int32 {
	mb, pb := f.bytes[0].Load(), f.bytes[1].Load()
	if mb < firstSampleBytes || pb < firstSampleBytes {
		return wayUndecided
	}
	// Per byte: mapped ns / mb > factor · pread ns / pb, without dividing.
	if float64(f.ns[0].Load())*float64(pb) > firstPreadFactor*float64(f.ns[1].Load())*float64(mb) {
		return wayPread
	}
	return wayMap
}

// threadCPU is the CPU time the calling thread has used, in nanoseconds, or -1. A raw
// system call, as the file's own reads are (rawio.go).
func threadCPU() int64 {
	var ts unix.Timespec
	if _, _, e := unix.RawSyscall(unix.SYS_CLOCK_GETTIME, unix.CLOCK_THREAD_CPUTIME_ID, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return -1
	}
	return ts.Nano()
}

package provider

import (
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// shmFile is a file of size bytes on tmpfs (/dev/shm), where File maps what it writes.
func shmFile(t testing.TB, size int64) string {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		t.Skip("no tmpfs at /dev/shm")
	}
	dir, err := os.MkdirTemp("/dev/shm", "eli-provider-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return fileIn(t, dir, size)
}

// openMapped opens path for writing and checks that it is mapped.
func openMapped(t *testing.T, path string) *File {
	t.Helper()
	p, err := Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	if !p.Mapped() {
		t.Fatal("a file on tmpfs is not mapped")
	}
	return p
}

// TestMappedReads: a file on tmpfs is read through its mapping, read-only opens too,
// and reads see what pwrite and punching did, at both ends of the file; files elsewhere
// are mapped only if they are on tmpfs as well.
func TestMappedReads(t *testing.T) {
	t.Parallel()
	path := shmFile(t, 1<<20)
	p := openMapped(t, path)
	if !p.Capabilities().SerialWrites {
		t.Fatal("a mapped file does not report serial writes: they are still pwrite")
	}
	ro, err := Open(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if !ro.Mapped() {
		t.Fatal("a read-only open is not mapped")
	}
	want := make([]byte, 1<<20)
	check := func(what string) {
		t.Helper()
		for _, q := range []*File{p, ro} {
			for _, r := range [][2]int{{0, 1 << 20}, {0, 5000}, {4095, 2}, {1<<20 - 4096, 4096}, {1<<20 - 1, 1}} {
				got := make([]byte, r[1])
				if _, err := q.ReadAt(got, int64(r[0])); err != nil {
					t.Fatalf("%s: read %d+%d: %v", what, r[0], r[1], err)
				}
				if !bytes.Equal(got, want[r[0]:r[0]+r[1]]) {
					t.Fatalf("%s: read %d+%d: not what was written", what, r[0], r[1])
				}
			}
		}
	}
	for i := range want {
		want[i] = byte(i*7 + i>>12)
	}
	if _, err := p.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	check("after a write")
	if err := p.Punch(4096, 8192); err != nil {
		t.Fatal(err)
	}
	clear(want[4096 : 4096+8192])
	check("after a punch")
	if _, err := p.WriteAt([]byte{1, 2, 3}, 1<<20-3); err != nil {
		t.Fatal(err)
	}
	copy(want[1<<20-3:], []byte{1, 2, 3})
	check("after a write at the end")
	// Past the mapped size, reads go to pread: io.EOF, as before.
	if n, err := p.ReadAt(make([]byte, 2), 1<<20-1); n != 1 || err != io.EOF {
		t.Fatalf("read across the end: %d, %v", n, err)
	}

	disk, err := Open(tempFile(t, 1<<20), false)
	if err != nil {
		t.Fatal(err)
	}
	defer disk.Close()
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(disk.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if disk.Mapped() != (st.Type == unix.TMPFS_MAGIC) {
		t.Fatalf("file system type %#x: mapped %v", st.Type, disk.Mapped())
	}
}

// TestMappedExtendAndFromFile: Extend maps the grown file anew (also one too small to
// map before), and FromFile maps what it wraps.
func TestMappedExtendAndFromFile(t *testing.T) {
	t.Parallel()
	path := shmFile(t, 0)
	p, err := Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.Mapped() {
		t.Fatal("an empty file was mapped")
	}
	if err := p.Extend(2 << 20); err != nil {
		t.Fatal(err)
	}
	if !p.Mapped() {
		t.Fatal("not mapped after Extend")
	}
	if _, err := p.WriteAt([]byte("end"), 2<<20-3); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 3)
	if _, err := p.ReadAt(got, 2<<20-3); err != nil || string(got) != "end" {
		t.Fatalf("read %q, %v", got, err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	q, err := FromFile(f, path)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if !q.Mapped() {
		t.Fatal("FromFile did not map")
	}
}

// TestMappedFaultIsError: a read of a mapped page that no longer exists (another process
// truncated the file) is an error for that read, or pread's short read, never a crash,
// and the provider keeps working where the file still is.
func TestMappedFaultIsError(t *testing.T) {
	t.Parallel()
	path := shmFile(t, 1<<20)
	p := openMapped(t, path)
	if _, err := p.WriteAt(make([]byte, 1<<20), 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, 64<<10); err != nil {
		t.Fatal(err)
	}
	// A first read goes to pread (as mincore would send it), which sees the new end.
	if n, err := p.ReadAt(make([]byte, 4096), 512<<10); n != 0 || err != io.EOF {
		t.Fatalf("read past the truncated end: %d, %v", n, err)
	}
	// A copy that passed mincore just before the truncation faults: an error.
	_, err := p.copyMapped(make([]byte, 4096), 512<<10)
	if err == nil || !strings.Contains(err.Error(), "faulted") {
		t.Fatalf("copy past the truncated end: %v, want a fault error", err)
	}
	if _, err := p.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("read inside the file after a fault: %v", err)
	}
}

// TestMappedReadsLeaveHoles: reads of a mapped file see what was written, also in ranges
// that are part written, part hole, and reading holes does not allocate them (which a
// read through the mapping would).
func TestMappedReadsLeaveHoles(t *testing.T) {
	t.Parallel()
	const size = 16 << 20
	path := shmFile(t, size)
	p := openMapped(t, path)
	data := bytes.Repeat([]byte{0x5a}, 64<<10)
	if _, err := p.WriteAt(data, 1<<20); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ off, n int64 }{
		{1 << 20, 64 << 10},       // written
		{1<<20 + 100, 1000},       // inside one written page, unaligned
		{1<<20 - 4096, 8192},      // hole, then written
		{1<<20 + 60<<10, 8 << 10}, // written, then hole
		{4 << 20, 8 << 20},        // hole
		{size - 4096, 4096},       // hole at the end
	} {
		got := make([]byte, c.n)
		if _, err := p.ReadAt(got, c.off); err != nil {
			t.Fatalf("read %d+%d: %v", c.off, c.n, err)
		}
		want := make([]byte, c.n)
		for i := range want {
			if o := c.off + int64(i); o >= 1<<20 && o < 1<<20+64<<10 {
				want[i] = 0x5a
			}
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("read %d+%d: wrong bytes", c.off, c.n)
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if used := st.Blocks * 512; used > 1<<20 {
		t.Fatalf("%d bytes allocated after writing 64 KiB and reading holes", used)
	}
}

// TestWriteMapped: a file on tmpfs open for writing takes writes through its mapping,
// which pread and a second open see, also into a hole and at the end; a read-only open,
// a range outside the file and a file not on tmpfs leave the write to WriteAt (ok
// false), and a write into a page that no longer exists is an error, not a crash.
func TestWriteMapped(t *testing.T) {
	t.Parallel()
	const size = 1 << 20
	path := shmFile(t, size)
	p := openMapped(t, path)
	want := make([]byte, size)
	write := func(b []byte, off int64) {
		t.Helper()
		ok, err := p.WriteMapped(b, off)
		if !ok || err != nil {
			t.Fatalf("WriteMapped %d+%d: %v, %v", off, len(b), ok, err)
		}
		copy(want[off:], b)
	}
	write(bytes.Repeat([]byte{0xa5}, 4096), 8192)  // into a hole
	write([]byte("record"), 8192+100)              // unaligned, inside a page
	write(bytes.Repeat([]byte{0x3c}, 6000), 60000) // across a page boundary
	write([]byte("end"), size-3)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, size)
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("pread through another descriptor does not see what was written through the mapping")
	}
	for _, r := range [][2]int64{{size - 2, 3}, {-1, 1}, {size, 1}} {
		if ok, err := p.WriteMapped(make([]byte, r[1]), r[0]); ok || err != nil {
			t.Fatalf("WriteMapped %d+%d outside the file: %v, %v", r[0], r[1], ok, err)
		}
	}

	ro, err := Open(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if ok, err := ro.WriteMapped([]byte{1}, 0); ok || err != nil {
		t.Fatalf("WriteMapped on a read-only open: %v, %v", ok, err)
	}
	disk, err := Open(tempFile(t, size), false)
	if err != nil {
		t.Fatal(err)
	}
	defer disk.Close()
	if ok, _ := disk.WriteMapped([]byte{1}, 0); ok != disk.Mapped() {
		t.Fatalf("WriteMapped on a file mapped %v took the write: %v", disk.Mapped(), ok)
	}

	if err := os.Truncate(path, 64<<10); err != nil {
		t.Fatal(err)
	}
	ok, err := p.WriteMapped(make([]byte, 4096), 512<<10)
	if !ok || err == nil || !strings.Contains(err.Error(), "faulted") {
		t.Fatalf("WriteMapped past the truncated end: %v, %v; want a fault error", ok, err)
	}
	write([]byte("still"), 100)
}

// TestMappedResidentRegions: reads of a region whose pages are all in memory come to skip
// mincore (the region is remembered as resident), a region with a hole never does, and
// a punch forgets the regions it touches, so that reading the new hole afterwards still
// allocates nothing.
func TestMappedResidentRegions(t *testing.T) {
	t.Parallel()
	const size = 3 * residentRegion
	path := shmFile(t, size)
	p := openMapped(t, path)
	full := bytes.Repeat([]byte{0x77}, residentRegion)
	if _, err := p.WriteAt(full, 0); err != nil { // region 0: all written
		t.Fatal(err)
	}
	if _, err := p.WriteAt(full[:residentRegion/2], residentRegion); err != nil { // region 1: half
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	readMany := func(region int64) {
		t.Helper()
		for i := range 4 * probeEvery {
			off := region*residentRegion + int64(i%256)*4096
			if _, err := p.ReadAt(buf, off); err != nil {
				t.Fatal(err)
			}
		}
	}
	readMany(0)
	readMany(1)
	if !p.isResident(0, residentRegion) {
		t.Fatal("a region written whole and read often is not known resident")
	}
	if p.isResident(residentRegion, 1) {
		t.Fatal("a region with a hole is known resident")
	}
	if p.isResident(residentRegion-1, 2) {
		t.Fatal("a range across a resident region and one with a hole counts as resident")
	}
	if err := p.Punch(4096, 64<<10); err != nil {
		t.Fatal(err)
	}
	if p.isResident(0, 1) {
		t.Fatal("a region still known resident after a punch in it")
	}
	for range 4 * probeEvery {
		if _, err := p.ReadAt(buf, 8192); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, make([]byte, 4096)) {
			t.Fatal("a punched page does not read as zeroes")
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if want := int64(residentRegion + residentRegion/2 - 64<<10); st.Blocks*512 > want {
		t.Fatalf("%d bytes allocated, want at most %d: reading the punched hole allocated it", st.Blocks*512, want)
	}
}

// writtenShm is a file of size bytes on tmpfs written whole with a pattern, and the
// pattern.
func writtenShm(t *testing.T, size int64) (string, []byte) {
	t.Helper()
	path := shmFile(t, size)
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i*29 + i>>16)
	}
	w := openMapped(t, path)
	if _, err := w.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	return path, want
}

// readWant reads n bytes at off from p and checks them against want.
func readWant(t *testing.T, p *File, want []byte, off, n int64) {
	t.Helper()
	got := make([]byte, n)
	if _, err := p.ReadAt(got, off); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want[off:off+n]) {
		t.Fatalf("read %d+%d: not what was written", off, n)
	}
}

// TestMappedFirstReads: where first reads go by pread, the first read of a chunk leaves
// the mapping untouched (no page of it mapped into the process, which /proc/self/pagemap
// shows), a second read of it copies out of the mapping, and a read that reaches a chunk
// not read before is pread again; where they go through the mapping, a first read maps
// its pages.
func TestMappedFirstReads(t *testing.T) {
	t.Parallel()
	const size = 1 << 20
	path, want := writtenShm(t, size)
	pagemap, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Fatal(err)
	}
	defer pagemap.Close()
	for _, way := range []int32{wayPread, wayMap} {
		p := openMapped(t, path)
		p.first.way.Store(way)
		// mapped counts the pages of [off, off+n) of p's read mapping present in this
		// process's page tables (pagemap's bit 63, proc(5)).
		mapped := func(off, n int64) int {
			t.Helper()
			base := uintptr(unsafe.Pointer(&p.mem[0]))
			pages := int(n / pageSize)
			ents := make([]byte, 8*pages)
			if _, err := pagemap.ReadAt(ents, int64((base+uintptr(off))/uintptr(pageSize))*8); err != nil {
				t.Fatal(err)
			}
			present := 0
			for i := range pages {
				if binary.LittleEndian.Uint64(ents[8*i:])>>63 == 1 {
					present++
				}
			}
			return present
		}
		read := func(off, n int64) { t.Helper(); readWant(t, p, want, off, n) }
		a, b := int64(2*seenChunk), int64(8*seenChunk)
		read(a, seenChunk)
		read(b+100, 5000)
		if way == wayMap {
			if m := mapped(a, seenChunk); m != int(seenChunk/pageSize) {
				t.Fatalf("first reads through the mapping: %d of %d pages mapped", m, seenChunk/pageSize)
			}
			continue
		}
		if m := mapped(a, seenChunk) + mapped(b, seenChunk); m != 0 {
			t.Fatalf("first reads by pread mapped %d pages", m)
		}
		read(a+4096, 8192)
		if m := mapped(a+4096, 8192); m != 2 {
			t.Fatalf("a second read of a chunk mapped %d of its 2 pages; want a copy out of the mapping", m)
		}
		if m := mapped(b, seenChunk); m != 0 {
			t.Fatalf("a chunk read once has %d pages mapped after a read of another", m)
		}
		read(b, 2*seenChunk) // chunk b read before, chunk b+1 not
		if m := mapped(b, 2*seenChunk); m != 0 {
			t.Fatalf("a read that reaches a new chunk mapped %d pages; want pread", m)
		}
		read(b, 2*seenChunk)
		if m := mapped(b, 2*seenChunk); m != int(2*seenChunk/pageSize) {
			t.Fatalf("a read of two chunks read before mapped %d of their pages", m)
		}
	}
}

// TestFirstReadSamples: a fresh file's first whole reads of new chunks are samples,
// alternately through the mapping and by pread, each read right, until both ways have
// read firstSampleBytes; then the file has decided, as decide says, and takes no more
// samples. Reads of chunks read before, or shorter than a chunk, are no samples.
func TestFirstReadSamples(t *testing.T) {
	t.Parallel()
	const size = 8 << 20
	path, want := writtenShm(t, size)
	p := openMapped(t, path)
	read := func(off, n int64) { t.Helper(); readWant(t, p, want, off, n) }
	samples := func() int64 { return p.first.bytes[0].Load() + p.first.bytes[1].Load() }
	read(0, 4096)
	read(0, seenChunk)
	read(100, seenChunk)
	if s := samples(); s != 0 {
		t.Fatalf("%d bytes sampled by a short read and reads of a chunk read before", s)
	}
	off := int64(2 * seenChunk) // the reads above touched chunks 0 and 1
	for p.first.way.Load() == wayUndecided {
		if off+2*seenChunk > size {
			t.Fatalf("undecided after sampling %d bytes", samples())
		}
		read(off, 2*seenChunk)
		off += 2 * seenChunk
	}
	if got, want := off-2*seenChunk, int64(2*firstSampleBytes); got != want {
		t.Fatalf("decided after %d bytes of first reads, want %d (firstSampleBytes each way, alternating)", got, want)
	}
	for way := range 2 {
		if b := p.first.bytes[way].Load(); b != firstSampleBytes {
			t.Fatalf("way %d sampled %d bytes, want %d", way, b, firstSampleBytes)
		}
	}
	if got, want := p.first.way.Load(), p.first.decide(); got != want {
		t.Fatalf("way %d, but the samples decide %d", got, want)
	}
	before := samples()
	read(off, 2*seenChunk)
	if samples() != before {
		t.Fatal("a first read sampled after the decision")
	}
}

// TestFirstWayDecide: pread wins only where the mapping's first reads cost more than
// firstPreadFactor times as much per byte, and nothing is decided on too few bytes.
func TestFirstWayDecide(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		mapNs, mapBytes, preadNs, preadBytes int64
		want                                 int32
	}{
		{650, 1 << 20, 140, 1 << 20, wayPread}, // page tables dear
		{170, 1 << 20, 200, 1 << 20, wayMap},   // cheap
		{2 * 200, 1 << 20, 200, 1 << 20, wayMap},
		{2*200 + 1, 1 << 20, 200, 1 << 20, wayPread},
		{650, 2 << 20, 140, 1 << 20, wayPread}, // per byte
		{650, 8 << 20, 140, 1 << 20, wayMap},
		{650, 1<<20 - 1, 140, 1 << 20, wayUndecided},
		{650, 1 << 20, 140, 1<<20 - 1, wayUndecided},
	} {
		var f firstWay
		f.ns[0].Store(c.mapNs)
		f.bytes[0].Store(c.mapBytes)
		f.ns[1].Store(c.preadNs)
		f.bytes[1].Store(c.preadBytes)
		if got := f.decide(); got != c.want {
			t.Errorf("%+v: decide %d, want %d", c, got, c.want)
		}
	}
}

// TestMappedWalk: the first read that would ask mincore marks resident every region
// that lies wholly within the file's data, none that holds a hole, and the last region,
// shorter than the others, if the data reaches the end; the regions it marks read right.
func TestMappedWalk(t *testing.T) {
	t.Parallel()
	const size = 4*residentRegion + residentRegion/2
	path := shmFile(t, size)
	w := openMapped(t, path)
	want := make([]byte, size)
	write := func(off, n int64) {
		t.Helper()
		for i := off; i < off+n; i++ {
			want[i] = byte(i*31 + i>>12)
		}
		if _, err := w.WriteAt(want[off:off+n], off); err != nil {
			t.Fatal(err)
		}
	}
	write(0, residentRegion)                                 // region 0 whole
	write(residentRegion+4096, residentRegion-4096)          // region 1 but its first page
	write(2*residentRegion, residentRegion+residentRegion/2) // region 2 whole, half of 3
	write(4*residentRegion-4096, residentRegion/2+4096)      // end of 3, the short last one
	p := openMapped(t, path)
	for r := int64(0); r < 5; r++ {
		if p.isResident(r*residentRegion, 1) {
			t.Fatalf("region %d known resident before any read", r)
		}
	}
	got := make([]byte, 8192)
	if _, err := p.ReadAt(got, 3*residentRegion); err != nil { // a hole: zeroes
		t.Fatal(err)
	}
	for r, res := range []bool{true, false, true, false, true} {
		if p.isResident(int64(r)*residentRegion, 1) != res {
			t.Errorf("region %d: known resident %v, want %v", r, !res, res)
		}
	}
	all := make([]byte, size)
	for range 2 { // first reads, then reads of chunks read before
		if _, err := p.ReadAt(all, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(all, want) {
			t.Fatal("a read across walked regions and holes is not what was written")
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if alloc, written := st.Blocks*512, int64(size-residentRegion/2); alloc > written { // the holes: a page, and half a region less a page
		t.Fatalf("%d bytes allocated after writing %d and reading everything", alloc, written)
	}
}

// TestRawFile: on tmpfs, WriteAt, ReadOnce and Sync are raw system calls (rawFile) with
// os.File's contract: every byte where it belongs, across pieces of rawPiece; io.EOF at
// the end; a negative offset refused; after Close an error, never a write through a
// descriptor number reused since. Elsewhere they stay os.File's.
func TestRawFile(t *testing.T) {
	t.Parallel()
	const size = 3*rawPiece + 4096
	path := shmFile(t, size)
	p := openMapped(t, path)
	if p.raw == nil {
		t.Fatal("a file on tmpfs does not use raw system calls")
	}
	want := make([]byte, size)
	data := bytes.Repeat([]byte("0123456789abcdef"), (2*rawPiece+300)/16)
	copy(want[100:], data)
	if n, err := p.WriteAt(data, 100); err != nil || n != len(data) {
		t.Fatalf("WriteAt = %d, %v", n, err)
	}
	if err := p.Sync(); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the file does not hold what was written (%v)", err)
	}
	got := make([]byte, len(data))
	if n, err := p.ReadOnce(got, 100); err != nil || n != len(got) || !bytes.Equal(got, data) {
		t.Fatalf("ReadOnce = %d, %v (equal %v)", n, err, bytes.Equal(got, data))
	}
	if n, err := p.ReadOnce(got[:10], size-4); n != 4 || err != io.EOF {
		t.Fatalf("ReadOnce across the end = %d, %v, want 4, io.EOF", n, err)
	}
	if n, err := p.WriteAt([]byte("x"), -1); err == nil || n != 0 {
		t.Fatalf("WriteAt at -1 = %d, %v", n, err)
	}

	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	other := shmFile(t, 4096) // likely to take the closed descriptor's number
	o, err := os.OpenFile(other, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if _, err := p.WriteAt([]byte("late"), 0); err == nil {
		t.Fatal("WriteAt after Close succeeded")
	}
	if _, err := p.ReadOnce(got[:4], 0); err == nil {
		t.Fatal("ReadOnce after Close succeeded")
	}
	if err := p.Sync(); err == nil {
		t.Fatal("Sync after Close succeeded")
	}
	if got, _ := os.ReadFile(other); !bytes.Equal(got, make([]byte, 4096)) {
		t.Fatal("a write after Close reached another file")
	}

	var st unix.Statfs_t
	dir := t.TempDir()
	if unix.Statfs(dir, &st) == nil && st.Type != unix.TMPFS_MAGIC {
		q, err := Open(fileIn(t, dir, 4096), false)
		if err != nil {
			t.Fatal(err)
		}
		defer q.Close()
		if q.raw != nil {
			t.Fatal("a file outside tmpfs uses raw system calls")
		}
	}
}

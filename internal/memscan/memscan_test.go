package memscan

import (
	"crypto/rand"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// secretPattern returns random bytes in a mapping of their own (not the Go heap, so no
// stray copy is left by the collector), which Scan does not report since they are its
// patterns.
func secretPattern(t *testing.T, n int) []byte {
	t.Helper()
	m, err := unix.Mmap(-1, 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	rand.Read(m[:n])
	return m[:n:n]
}

// place copies p into dst a byte at a time: copy would move it through vector
// registers, which a signal at that instant saves on a signal stack, where a scan would
// find a second copy (see Scan).
//
//go:noinline
func place(dst, p []byte) {
	for i := range p {
		dst[i] = p[i]
	}
}

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// matchesAt lists the addresses where pattern i was found.
func matchesAt(r *Report, i int) []uint64 {
	var out []uint64
	for _, m := range r.Matches {
		if m.Pattern == i {
			out = append(out, m.Addr)
		}
	}
	return out
}

// heapBuf is where TestScanSelfHeapAndStack puts a pattern on the heap (a package
// variable, so that the buffer cannot live on a stack).
var heapBuf []byte

// TestScanSelfHeapAndStack places a pattern in a heap buffer and another in a
// goroutine's stack, finds each exactly where it was put, and finds neither once they are
// overwritten. (A goroutine's stack moves when it grows or shrinks, and the old copy is not
// cleared: the goroutine grows its stack before it takes the pattern, and the collector,
// which shrinks stacks, is off meanwhile.)
func TestScanSelfHeapAndStack(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	p0 := secretPattern(t, 32)
	p1 := secretPattern(t, 64)
	heapBuf = make([]byte, 4096)
	place(heapBuf[1000:], p0)

	placed, clearIt, cleared, done := make(chan uint64), make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		growStack(64)
		var stack [256]byte
		place(stack[7:], p1)
		placed <- addr(stack[7:])
		<-clearIt
		clear(stack[:])
		runtime.KeepAlive(&stack)
		cleared <- struct{}{}
		<-done
	}()
	defer close(done)
	onStack := <-placed

	r, err := Scan(0, p0, p1)
	if err != nil {
		t.Fatal(err)
	}
	if got := matchesAt(r, 0); len(got) != 1 || got[0] != addr(heapBuf[1000:]) {
		t.Errorf("pattern in the heap found at %x, want only %x; matches %v", got, addr(heapBuf[1000:]), r.Matches)
	}
	if got := matchesAt(r, 1); len(got) != 1 || got[0] != onStack {
		t.Errorf("pattern on the stack found at %x, want only %x; matches %v", got, onStack, r.Matches)
	}
	if r.Mappings == 0 || r.Bytes == 0 {
		t.Errorf("scanned %d mappings, %d bytes", r.Mappings, r.Bytes)
	}

	clear(heapBuf)
	clearIt <- struct{}{}
	<-cleared
	r, err = Scan(0, p0, p1)
	if err != nil {
		t.Fatal(err)
	}
	if r.Found(0) || r.Found(1) {
		t.Errorf("overwritten patterns still found: %v", r.Matches)
	}
}

// growStack uses about kib KiB of stack, so that the calling goroutine's stack has grown
// to that when it returns.
//
//go:noinline
func growStack(kib int) byte {
	var frame [1024]byte
	if kib <= 1 {
		return frame[0]
	}
	frame[0] = growStack(kib - 1)
	return frame[0]
}

// TestScanAcrossBoundaries puts patterns across a page boundary inside one mapping (with
// reads of one page, so across two reads) and across the boundary of two adjacent
// mappings (the kernel splits one when part of it is advised differently).
func TestScanAcrossBoundaries(t *testing.T) {
	page := os.Getpagesize()
	old := chunk
	chunk = page
	defer func() { chunk = old }()

	p := secretPattern(t, 48)
	m, err := unix.Mmap(-1, 0, 4*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	// Pages 2 and 3 become a mapping of their own.
	if err := unix.Madvise(m[2*page:], unix.MADV_DONTDUMP); err != nil {
		t.Fatal(err)
	}
	inPage := page - 20      // crosses from page 0 into page 1
	inMapping := 2*page - 30 // crosses from page 1 (first mapping) into page 2 (second)
	place(m[inPage:], p)
	place(m[inMapping:], p)

	r, err := Scan(0, p)
	if err != nil {
		t.Fatal(err)
	}
	got := matchesAt(r, 0)
	want := map[uint64]string{addr(m[inPage:]): "across a page", addr(m[inMapping:]): "across two mappings"}
	for a, what := range want {
		found := false
		for _, g := range got {
			found = found || g == a
		}
		if !found {
			t.Errorf("pattern %s (at %x) not found; found at %x", what, a, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("found %d times, want %d: %v", len(got), len(want), r.Matches)
	}
	splitSeen := false
	for _, mm := range r.Matches {
		if mm.Addr == addr(m[inMapping:]) {
			splitSeen = mm.Mapping.Start <= mm.Addr
		}
	}
	if !splitSeen {
		t.Errorf("the match across two mappings does not name the mapping it starts in: %v", r.Matches)
	}

	clear(m)
	if r, err := Scan(0, p); err != nil || r.Found(0) {
		t.Errorf("after clearing: %v, %v", r.Matches, err)
	}
}

// TestScanSkipsReadOnly: a pattern in a mapping that is not writable is not searched.
func TestScanSkipsReadOnly(t *testing.T) {
	p := secretPattern(t, 32)
	m, err := unix.Mmap(-1, 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	place(m[100:], p)
	if r, err := Scan(0, p); err != nil || !r.Found(0) {
		t.Fatalf("writable: found %v, %v", r, err)
	}
	if err := unix.Mprotect(m, unix.PROT_READ); err != nil {
		t.Fatal(err)
	}
	if r, err := Scan(0, p); err != nil || r.Found(0) {
		t.Errorf("read-only mapping searched: %v, %v", r.Matches, err)
	}
}

// TestScanOtherProcess scans a child process (the test binary run again, holding a pattern
// it was given on a pipe) by its pid.
func TestScanOtherProcess(t *testing.T) {
	if os.Getenv("MEMSCAN_CHILD") == "1" {
		child()
		return
	}
	p := secretPattern(t, 32)
	cmd := exec.Command(os.Args[0], "-test.run=^TestScanOtherProcess$")
	cmd.Env = append(os.Environ(), "MEMSCAN_CHILD=1")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	in.Write(p)
	buf := make([]byte, 64)
	n, _ := out.Read(buf) // the child says where it keeps the pattern
	at, err := strconv.ParseUint(strings.TrimSpace(string(buf[:n])), 16, 64)
	if err != nil {
		t.Fatalf("child said %q", buf[:n])
	}
	r, err := Scan(cmd.Process.Pid, p)
	if err != nil {
		t.Fatal(err)
	}
	if got := matchesAt(r, 0); len(got) == 0 || !contains(got, at) {
		t.Errorf("pattern in the child at %x not found (found at %x)", at, got)
	}
	in.Close()
	cmd.Wait()
	if _, err := Scan(cmd.Process.Pid, p); err == nil {
		t.Error("scan of an exited process succeeded")
	}
}

func contains(s []uint64, v uint64) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// child keeps what it reads on stdin in a mapping and prints its address, then waits
// for stdin to close.
func child() {
	m, _ := unix.Mmap(-1, 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	n, _ := os.Stdin.Read(m[200:])
	_ = n
	os.Stdout.WriteString(strconv.FormatUint(addr(m[200:]), 16) + "\n")
	var b [1]byte
	os.Stdin.Read(b[:])
	os.Exit(0)
}

func TestScanRejects(t *testing.T) {
	if _, err := Scan(0, []byte{}); err == nil {
		t.Error("empty pattern accepted")
	}
	if _, err := Scan(0, make([]byte, chunk+1)); err == nil {
		t.Error("pattern longer than a read accepted")
	}
}

func TestParseMaps(t *testing.T) {
	in := "00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/my prog\n" +
		"7ffd2b8d5000-7ffd2b8f6000 rw-p 00000000 00:00 0                          [stack]\n" +
		"7f0000000000-7f0000001000 rw-p 00000000 00:00 0\n" +
		"ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]\n"
	ms, err := parseMaps([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []Mapping{
		{0x400000, 0x452000, "r-xp", "/usr/bin/my prog"},
		{0x7ffd2b8d5000, 0x7ffd2b8f6000, "rw-p", "[stack]"},
		{0x7f0000000000, 0x7f0000001000, "rw-p", ""},
		{0xffffffffff600000, 0xffffffffff601000, "--xp", "[vsyscall]"},
	}
	if len(ms) != len(want) {
		t.Fatalf("got %v", ms)
	}
	for i := range want {
		if ms[i] != want[i] {
			t.Errorf("line %d: %+v, want %+v", i, ms[i], want[i])
		}
	}
	scan := []bool{false, true, true, false}
	for i, m := range ms {
		if scannable(m) != scan[i] {
			t.Errorf("%v: scannable = %v", m, !scan[i])
		}
	}
	if scannable(Mapping{Perms: "rw-p", Path: "[vvar]"}) {
		t.Error("[vvar] is scannable")
	}
	for _, bad := range []string{"nonsense\n", "zz-00 rw-p 0 0:0 0\n", "10-05 rw-p 0 0:0 0\n"} {
		if _, err := parseMaps([]byte(bad)); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// Package memscan finds byte patterns in a process's writable memory, for tests that
// check that key material is gone (issue 40: a suspended server must hold no key bytes).
// It reads /proc/PID/maps and /proc/PID/mem (proc(5)): every mapping that is readable and
// writable (the heap, stacks, anonymous mappings such as the Go runtime's arenas and
// eli's key mappings, a binary's data and bss) is searched; read-only and executable
// mappings (program text, read-only data) cannot have received a key at run time, and the
// kernel's [vvar] and [vsyscall] pages are not process memory.
//
// Scanning another process needs the right to ptrace it: root, or the same user for a
// dumpable process (eli's server makes itself non-dumpable, so only root can scan it).
// The target keeps running while it is read, so a scan of a busy process is a snapshot
// taken over time, not of one instant: scan a process that is quiet.
package memscan

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Mapping is one line of /proc/PID/maps.
type Mapping struct {
	Start, End uint64
	Perms      string // "rw-p", ...
	Path       string // a file, "[heap]", "[stack]", "[anon:NAME]", or "" for anonymous memory
}

func (m Mapping) String() string {
	return fmt.Sprintf("%x-%x %s %s", m.Start, m.End, m.Perms, m.Path)
}

// Match is one occurrence of a pattern.
type Match struct {
	Pattern int    // index in the patterns given to Scan
	Addr    uint64 // where it starts
	Mapping Mapping
}

func (m Match) String() string {
	return fmt.Sprintf("pattern %d at %#x in %v", m.Pattern, m.Addr, m.Mapping)
}

// Unreadable is a range of a scanned mapping that could not be read.
type Unreadable struct {
	Mapping    Mapping
	Start, End uint64
	Err        error
}

// Report is what Scan found.
type Report struct {
	Matches    []Match
	Mappings   int    // mappings searched
	Bytes      uint64 // bytes read and searched
	Unreadable []Unreadable
}

// Found reports whether pattern i was found.
func (r *Report) Found(i int) bool {
	for _, m := range r.Matches {
		if m.Pattern == i {
			return true
		}
	}
	return false
}

// chunk is how much of a mapping is read at a time; tests shrink it to a page to put
// patterns across reads.
var chunk = 1 << 20

// Scan searches the readable-writable mappings of process pid (0: this process) for each
// pattern and reports every place each one starts. A pattern that spans two reads, two
// pages or two adjacent mappings is found. When scanning this process, the patterns' own
// bytes are not reported (they are in memory too), nor is Scan's read buffer, which lives
// outside the Go heap for that reason. A process's memory also holds what its vector
// registers held when a signal interrupted it (the kernel saves them in a signal frame on
// the thread's signal stack, which is process memory, and nothing clears it): a caller
// that places a test pattern itself copies it a byte at a time, as Scan compares.
//
// A range the kernel refuses to read (a device mapping, memory unmapped during the scan)
// is listed in Report.Unreadable, not an error: the caller decides whether that makes the
// scan inconclusive. Errors are for what stops the scan as a whole (no such process, no
// permission to read it).
func Scan(pid int, patterns ...[]byte) (*Report, error) {
	longest := 0
	for i, p := range patterns {
		if len(p) == 0 {
			return nil, fmt.Errorf("memscan: pattern %d is empty", i)
		}
		longest = max(longest, len(p))
	}
	if longest > chunk {
		return nil, fmt.Errorf("memscan: a pattern of %d bytes is longer than a read (%d)", longest, chunk)
	}
	proc := "/proc/self"
	self := pid == 0 || pid == os.Getpid()
	if pid != 0 {
		proc = "/proc/" + strconv.Itoa(pid)
	}
	maps, err := os.ReadFile(proc + "/maps")
	if err != nil {
		return nil, fmt.Errorf("memscan: read the mappings of %s: %w", proc, err)
	}
	mappings, err := parseMaps(maps)
	if err != nil {
		return nil, fmt.Errorf("memscan: %s/maps: %w", proc, err)
	}
	mem, err := os.Open(proc + "/mem")
	if err != nil {
		return nil, fmt.Errorf("memscan: open the memory of %s (scanning another process needs root or ptrace rights to it): %w", proc, err)
	}
	defer mem.Close()

	// The buffer holds the tail of the previous read (longest-1 bytes) then a new read.
	bufMem, err := unix.Mmap(-1, 0, chunk+longest, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("memscan: map a read buffer: %w", err)
	}
	defer unix.Munmap(bufMem)

	var skip [][2]uint64
	if self {
		skip = append(skip, span(bufMem))
		for _, p := range patterns {
			skip = append(skip, span(p))
		}
	}
	s := &scanner{mem: mem, patterns: patterns, longest: longest, buf: bufMem, skip: skip}
	rep := &Report{}
	prevEnd := uint64(0)
	for _, m := range mappings {
		if !scannable(m) {
			prevEnd = 0
			continue
		}
		if m.Start != prevEnd {
			s.tail = 0 // not adjacent: nothing carries over
		}
		rep.Mappings++
		s.scan(m, rep)
		s.prev = m
		prevEnd = m.End
	}
	return rep, nil
}

// span is the address range of b.
func span(b []byte) [2]uint64 {
	if len(b) == 0 {
		return [2]uint64{}
	}
	start := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	return [2]uint64{start, start + uint64(len(b))}
}

// scannable: readable and writable, and process memory.
func scannable(m Mapping) bool {
	if len(m.Perms) < 2 || m.Perms[0] != 'r' || m.Perms[1] != 'w' {
		return false
	}
	switch m.Path {
	case "[vvar]", "[vvar_vclock]", "[vsyscall]", "[vdso]":
		return false
	}
	return true
}

type scanner struct {
	mem      io.ReaderAt
	patterns [][]byte
	longest  int
	buf      []byte
	skip     [][2]uint64
	tail     int     // bytes at the start of buf carried over from the previous read
	tailAddr uint64  // their address
	prev     Mapping // the mapping scanned before, which a carried-over tail may be from
}

// scan reads m in chunks, each searched together with the tail of the one before.
func (s *scanner) scan(m Mapping, rep *Report) {
	for off := m.Start; off < m.End; {
		n := int(min(uint64(chunk), m.End-off))
		got, err := s.mem.ReadAt(s.buf[s.tail:s.tail+n], int64(off))
		if err != nil && !errors.Is(err, io.EOF) || got == 0 {
			if err == nil || errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			// Skip one page past the failure and go on; what carried over is lost.
			page := uint64(os.Getpagesize())
			bad := off + uint64(got)
			next := min((bad/page+1)*page, m.End)
			rep.Unreadable = append(rep.Unreadable, Unreadable{Mapping: m, Start: bad, End: next, Err: err})
			rep.Bytes += uint64(got)
			s.tail = 0
			off = next
			continue
		}
		rep.Bytes += uint64(got)
		if s.tail == 0 {
			s.tailAddr = off
		}
		window := s.buf[:s.tail+got]
		s.search(window, s.tailAddr, m, rep)
		// Keep the last longest-1 bytes: a pattern that starts there ends in the next read.
		keep := min(s.longest-1, len(window))
		copy(s.buf, window[len(window)-keep:])
		s.tailAddr += uint64(len(window) - keep)
		s.tail = keep
		off += uint64(got)
	}
}

// search reports each pattern in window, which starts at addr. A match that starts in
// the carried-over tail and ends within it was already reported by the previous search.
func (s *scanner) search(window []byte, addr uint64, m Mapping, rep *Report) {
	for i, p := range s.patterns {
		for from := 0; ; {
			at := index(window, from, p)
			if at < 0 {
				break
			}
			from = at + 1
			if at+len(p) <= s.tail {
				continue
			}
			a := addr + uint64(at)
			if s.skipped(a, uint64(len(p))) {
				continue
			}
			mm := m
			if a < m.Start {
				mm = s.prev // it starts in the tail of the adjacent mapping before
			}
			rep.Matches = append(rep.Matches, Match{Pattern: i, Addr: a, Mapping: mm})
		}
	}
}

// index is the first place at or after from where p starts in w, or -1. Unlike
// bytes.Index it never holds p in vector registers, only its first byte (IndexByte) and
// then one byte at a time: a signal that interrupts a scan of this process saves the
// registers in a signal frame, and a pattern saved there would be found by the next scan.
func index(w []byte, from int, p []byte) int {
	for from+len(p) <= len(w) {
		j := bytes.IndexByte(w[from:len(w)-len(p)+1], p[0])
		if j < 0 {
			return -1
		}
		at := from + j
		k := 1
		for k < len(p) && w[at+k] == p[k] {
			k++
		}
		if k == len(p) {
			return at
		}
		from = at + 1
	}
	return -1
}

func (s *scanner) skipped(a, n uint64) bool {
	for _, r := range s.skip {
		if a >= r[0] && a+n <= r[1] {
			return true
		}
	}
	return false
}

// parseMaps reads /proc/PID/maps lines: "start-end perms offset dev inode path".
func parseMaps(b []byte) ([]Mapping, error) {
	var out []Mapping
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		f := strings.Fields(line)
		if len(f) < 5 {
			return nil, fmt.Errorf("unexpected line %q", line)
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if !ok || err1 != nil || err2 != nil || end < start {
			return nil, fmt.Errorf("unexpected range in %q", line)
		}
		m := Mapping{Start: start, End: end, Perms: f[1]}
		if len(f) > 5 {
			// The path is the rest of the line after the inode (it may hold spaces).
			rest := line
			for range 5 {
				rest = strings.TrimLeft(rest, " ")
				if k := strings.IndexByte(rest, ' '); k >= 0 {
					rest = rest[k:]
				}
			}
			m.Path = strings.TrimSpace(rest)
		}
		out = append(out, m)
	}
	return out, sc.Err()
}

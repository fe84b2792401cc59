package integration

import (
	"strconv"
	"strings"
	"testing"
)

// layout is where a volume keeps what, computed from docs/format.md and the header fields
// `eli dump` prints, never from eli's Go code: the tests that tamper with a provider or
// read its ciphertext find their bytes the way an attacker with the spec would.
type layout struct {
	mode string
	S    int64 // sector size
	N    int64 // data sectors
	D    int64 // data offset
	J    int64 // journal length
	P    int64 // provider size recorded in the header
}

// recordSize is the size of a metadata record (nonce and tag) in authenticated modes.
const recordSize = 40

// dumpLayout runs `eli dump` on provider and reads the layout from its output.
func (e *env) dumpLayout(provider string) layout {
	e.t.Helper()
	out := e.OK("dump", provider).Stdout
	field := func(name string) string {
		for _, line := range strings.Split(out, "\n") {
			if v, ok := strings.CutPrefix(line, name+":"); ok {
				return strings.TrimSpace(v)
			}
		}
		e.t.Fatalf("eli dump has no %q line:\n%s", name, out)
		return ""
	}
	num := func(name string) int64 {
		v := strings.Fields(field(name))
		if len(v) == 0 {
			e.t.Fatalf("eli dump: empty %q", name)
		}
		n, err := strconv.ParseInt(v[0], 10, 64)
		if err != nil {
			e.t.Fatalf("eli dump: %q: %v", name, err)
		}
		return n
	}
	return layout{mode: field("mode"), S: num("sector size"), N: num("sectors"), D: num("data offset"),
		J: num("journal length"), P: num("provider size")}
}

// authenticated reports whether the mode keeps a record per sector (MetaSize 40).
func (l layout) authenticated() bool { return l.J > 0 }

// size is the size of the export.
func (l layout) size() int64 { return l.N * l.S }

// metaBlock is M = max(S, 4096); perGroup is R = floor(M / 40); group is G = M + R·S.
func (l layout) metaBlock() int64 { return max(l.S, 4096) }
func (l layout) perGroup() int64  { return l.metaBlock() / recordSize }
func (l layout) group() int64     { return l.metaBlock() + l.perGroup()*l.S }

// dataAt is the provider offset of sector i's stored bytes: D + i·S in length-preserving
// modes, D + g·G + M + j·S in authenticated ones (g = i div R, j = i mod R).
func (l layout) dataAt(t testing.TB, i int64) int64 {
	t.Helper()
	if i < 0 || i >= l.N {
		t.Fatalf("sector %d outside a volume of %d sectors", i, l.N)
	}
	if !l.authenticated() {
		return l.D + i*l.S
	}
	g, j := i/l.perGroup(), i%l.perGroup()
	return l.D + g*l.group() + l.metaBlock() + j*l.S
}

// recordAt is the provider offset of sector i's 40-byte record: D + g·G + 40·j.
func (l layout) recordAt(t testing.TB, i int64) int64 {
	t.Helper()
	if !l.authenticated() {
		t.Fatalf("mode %s has no records", l.mode)
	}
	if i < 0 || i >= l.N {
		t.Fatalf("sector %d outside a volume of %d sectors", i, l.N)
	}
	g, j := i/l.perGroup(), i%l.perGroup()
	return l.D + g*l.group() + recordSize*j
}

// headerB is the offset of header copy B for a provider of size p: (p − p mod 4096) − 4096.
func headerB(p int64) int64 { return p - p%4096 - 4096 }

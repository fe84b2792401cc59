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
	V    int64 // format version
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
		J: num("journal length"), P: num("provider size"), V: num("version")}
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
// modes, blockAt(g) + M + j·S in authenticated ones (g = i div R, j = i mod R).
func (l layout) dataAt(t testing.TB, i int64) int64 {
	t.Helper()
	if i < 0 || i >= l.N {
		t.Fatalf("sector %d outside a volume of %d sectors", i, l.N)
	}
	if !l.authenticated() {
		return l.D + i*l.S
	}
	g, j := i/l.perGroup(), i%l.perGroup()
	return l.blockAt(g) + l.metaBlock() + j*l.S
}

// blockAt is the offset of group g's metadata block: D + g·G in format version 1; in
// version 2, D + 7·4096 + Σ_{m=0}^{6} (⌊g / 128^m⌋ mod 128)·U_m with U_0 = G and
// U_m = 4096 + 128·U_{m−1} (docs/format.md, "Format version 2").
func (l layout) blockAt(g int64) int64 {
	if l.V != 2 {
		return l.D + g*l.group()
	}
	pos, u := l.D+7*4096, l.group()
	for m := 0; m < 7 && g > 0; m++ {
		pos += g % 128 * u
		g /= 128
		u = 4096 + 128*u
	}
	return pos
}

// recordAt is the provider offset of sector i's 40-byte record: blockAt(g) + 40·j.
func (l layout) recordAt(t testing.TB, i int64) int64 {
	t.Helper()
	if !l.authenticated() {
		t.Fatalf("mode %s has no records", l.mode)
	}
	if i < 0 || i >= l.N {
		t.Fatalf("sector %d outside a volume of %d sectors", i, l.N)
	}
	g, j := i/l.perGroup(), i%l.perGroup()
	return l.blockAt(g) + recordSize*j
}

// headerB is the offset of header copy B for a provider of size p: (p − p mod 4096) − 4096.
func headerB(p int64) int64 { return p - p%4096 - 4096 }

package integration

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"os"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

// TestTreeFromSpec recomputes a format version 2 volume's hash tree from its bytes with
// nothing but docs/format.md ("Format version 2": node positions, digests, the journal
// slot) and the header fields `eli dump` prints: every node's slots must be its children's
// digests, and the top node's digest the root that dump reads from the newest journal
// slot. It checks the document as much as eli.
func TestTreeFromSpec(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdcopy", "libnbd-bin")
	e := newEnv(t, false)
	img := e.create(volume{name: "spec.img", size: "24M", sector: 512})
	l := e.dumpLayout(img)
	if l.V != 2 {
		t.Fatalf("default volume is version %d", l.V)
	}
	var data []byte
	for i := int64(0); i < 300*l.perGroup()/3; i += 7 {
		data = append(data, sectorContent(i, l.S)...)
	}
	uri := e.Attach(img)
	pythonNBD(t, data, "pwrite", uri, "4096")
	e.detach("spec.img")

	raw, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	// The root dump prints: the newest slot's, as read.
	var root []byte
	for _, line := range strings.Split(e.OK("dump", img).Stdout, "\n") {
		if v, ok := strings.CutPrefix(line, "tree root:"); ok {
			root, err = hex.DecodeString(strings.Fields(v)[0])
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(root) != 32 {
		t.Fatal("eli dump prints no tree root")
	}
	// The journal's two slots: the newest opening one carries that root at bytes 24..56.
	half := l.J / 2
	var newest []byte
	var gen, where uint64
	for k := int64(0); k < 2; k++ {
		slot := raw[65536+k*half : 65536+k*half+80]
		if string(slot[:8]) == "ELIJRNL2" && binary.LittleEndian.Uint64(slot[8:]) >= gen {
			gen, newest, where = binary.LittleEndian.Uint64(slot[8:]), slot, uint64(k)
		}
	}
	if newest == nil || gen == 0 || gen%2 != where || !bytes.Equal(newest[24:56], root) {
		t.Fatal("the newest journal slot (generation g in slot g mod 2) does not carry the root dump prints")
	}

	M := l.metaBlock()
	groups := (l.N + l.perGroup() - 1) / l.perGroup()
	digest := func(level int, index int64, b []byte) []byte {
		if bytes.Equal(b, make([]byte, len(b))) {
			return make([]byte, 32)
		}
		h := sha256.New()
		h.Write([]byte("eli-tree-v2"))
		h.Write([]byte{byte(level)})
		h.Write(binary.LittleEndian.AppendUint64(nil, uint64(index)))
		for p := 0; p < len(b); p += 512 {
			s := sha256.Sum256(b[p : p+512])
			h.Write(s[:])
		}
		return h.Sum(nil)
	}
	// U_0 = G, U_m = 4096 + 128·U_{m−1}; NodePos(L, k) = D + (7−L)·4096 + Σ_{m=L}^{6}
	// (⌊k/128^(m−L)⌋ mod 128)·U_m.
	var U [7]int64
	U[0] = l.group()
	for m := 1; m < 7; m++ {
		U[m] = 4096 + 128*U[m-1]
	}
	nodePos := func(level int, k int64) int64 {
		pos := l.D + int64(7-level)*4096
		for m := level; m < 7 && k > 0; m++ {
			pos += k % 128 * U[m]
			k /= 128
		}
		return pos
	}
	children := make([][]byte, groups)
	for g := int64(0); g < groups; g++ {
		p := l.blockAt(g)
		children[g] = digest(0, g, raw[p:p+M])
	}
	nonzero := 0
	for _, c := range children {
		if !bytes.Equal(c, make([]byte, 32)) {
			nonzero++
		}
	}
	if nonzero < 2 {
		t.Fatalf("only %d metadata blocks hold records: the workload wrote too little", nonzero)
	}
	for level := 1; level <= 7; level++ {
		width := (int64(len(children)) + 127) / 128
		next := make([][]byte, width)
		for k := int64(0); k < width; k++ {
			p := nodePos(level, k)
			node := raw[p : p+4096]
			for c := int64(0); c < 128; c++ {
				want := make([]byte, 32)
				if i := k*128 + c; i < int64(len(children)) {
					want = children[i]
				}
				if !bytes.Equal(node[c*32:c*32+32], want) {
					t.Fatalf("node (%d, %d) slot %d does not hold its child's digest", level, k, c)
				}
			}
			next[k] = digest(level, k, node)
		}
		children = next
	}
	if len(children) != 1 || !bytes.Equal(children[0], root) {
		t.Fatalf("the top node's digest %x is not the root %x", children[0], root)
	}
}

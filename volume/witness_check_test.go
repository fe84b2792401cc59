package volume

import (
	"encoding/binary"
	"errors"
	"path/filepath"
	"testing"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/elitest"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// TestCheckWitnessTornFirstCommit: a witness written at attach of a volume that never
// committed (generation 0) meets a provider whose first journal slot was torn by a kill
// in the middle of its copy into the mapping: the magic and part of a root are there,
// the generation still reads 0. The quick check without the key must not call that a
// fork (it failed so: a CI run of the crash simulation found the torn slot), while a
// witness past generation 0 still refuses a provider at the same generation with
// another root.
func TestCheckWitnessTornFirstCommit(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path, l, mk := elitest.VolumeVersion(t, dir, 8<<20, sector.ModeXChaCha20Poly1305, layout.Version2)
	defer mk.Wipe()
	if !l.Tree() {
		t.Fatal("the test volume has no tree: not format version 2")
	}
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	hdr, err := keys.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	torn := make([]byte, 80)
	copy(torn, "ELIJRNL2")
	for i := 24; i < 40; i++ {
		torn[i] = byte(i * 7)
	}
	if _, err := p.WriteAt(torn, l.JournalSlotOffset(0)); err != nil {
		t.Fatal(err)
	}
	peek, ok, err := blockdev.PeekFreshness(p, l)
	if err != nil || !ok || peek.Generation != 0 || peek.Root == ([32]byte{}) {
		t.Fatalf("peek of the torn slot: %+v %v %v; want generation 0 with part of a root", peek, ok, err)
	}

	wit := filepath.Join(dir, "witness")
	if err := writeWitness(wit, hdr.VolumeID, blockdev.Freshness{}); err != nil {
		t.Fatal(err)
	}
	if err := CheckWitness(wit, p, hdr); err != nil {
		t.Errorf("a witness at generation 0 refused a torn first slot: %v", err)
	}

	// The same root check past generation 0 still refuses.
	binary.LittleEndian.PutUint64(torn[8:], 5)
	if _, err := p.WriteAt(torn, l.JournalSlotOffset(0)); err != nil {
		t.Fatal(err)
	}
	if err := writeWitness(wit, hdr.VolumeID, blockdev.Freshness{Generation: 5, Root: [32]byte{1}}); err != nil {
		t.Fatal(err)
	}
	var rb *RollbackError
	if err := CheckWitness(wit, p, hdr); !errors.As(err, &rb) || !rb.Fork {
		t.Errorf("generation 5 with another root: %v, want a fork refused", err)
	}
}

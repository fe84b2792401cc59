package remote

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/elidisk/eli/provider"
)

// fileStore is a Store over a temporary file standing in for an export, with a short
// heartbeat so that claims do not wait seconds. Stores made by one test over the same
// path act as two hosts.
func fileStore(t *testing.T, path string) *Store {
	t.Helper()
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	return newStore(p, path, 50*time.Millisecond)
}

func newExport(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "export")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestMarkRoundTrip(t *testing.T) {
	t.Parallel()
	m := Mark{State: Held, Interval: 1500 * time.Millisecond, Counter: 42, Host: "storage-7", Time: time.Unix(0, 123456789)}
	m.Instance[3] = 9
	got, err := decodeMark(m.encode())
	if err != nil {
		t.Fatal(err)
	}
	if got != m {
		t.Fatalf("decoded %+v, want %+v", got, m)
	}
	for _, tc := range []struct {
		name string
		edit func(b []byte)
	}{
		{"flipped counter", func(b []byte) { b[32] ^= 1 }},
		{"byte after the checksum", func(b []byte) { b[4000] = 1 }},
		{"host length past the name", func(b []byte) { b[48] = 255 }},
	} {
		b := m.encode()
		tc.edit(b)
		if _, err := decodeMark(b); !errors.Is(err, errBadMark) {
			t.Errorf("%s: err %v, want errBadMark", tc.name, err)
		}
	}
	if z, err := decodeMark(make([]byte, MarkLen)); err != nil || z.State != Empty {
		t.Fatalf("zero block: %+v %v", z, err)
	}
	foreign := bytes.Repeat([]byte{0x5A}, MarkLen) // what the provider held before eli
	if z, err := decodeMark(foreign); err != nil || z.State != Empty {
		t.Fatalf("block without the magic: %+v %v, want Empty", z, err)
	}
}

// The ownership block is the Store's: writes from above skip it, reads see zeroes.
func TestMarkHidden(t *testing.T) {
	path := newExport(t)
	s := fileStore(t, path)
	defer s.Close()
	if err := s.Claim(ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{0xAB}, 3*4096)
	if _, err := s.WriteAt(data, 2048); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if _, err := s.ReadAt(got, 2048); err != nil {
		t.Fatal(err)
	}
	want := bytes.Clone(data)
	clear(want[4096-2048 : 8192-2048])
	if !bytes.Equal(got, want) {
		t.Fatal("reads through the Store do not show the ownership block as zeroes around written data")
	}
	if err := s.Punch(0, 65536); err != nil {
		t.Fatal(err)
	}
	m, err := s.readMark()
	if err != nil || m.State != Held {
		t.Fatalf("mark after writes and a punch over it: %+v %v", m, err)
	}
}

func TestClaim(t *testing.T) {
	path := newExport(t)

	a := fileStore(t, path)
	if err := a.Claim(ClaimOptions{}); err != nil {
		t.Fatalf("claim of an empty block: %v", err)
	}
	// A live owner: a second claimant waits, sees the counter move, refuses.
	b := fileStore(t, path)
	err := b.Claim(ClaimOptions{})
	var held *HeldError
	if !errors.As(err, &held) || held.Instance != a.Instance() {
		t.Fatalf("claim of a live volume: %v, want HeldError naming %s", err, a.Instance())
	}
	// Released at Close: the next claim is at once.
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if m, _ := b.readMark(); m.State != Released {
		t.Fatalf("mark after Close: %+v", m)
	}
	start := time.Now()
	if err := b.Claim(ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	if time.Since(start) > 10*time.Second {
		t.Fatal("a released volume was not claimed at once") // generous: a hang guard
	}
	// A stale owner (its heartbeat stopped without a release): taken over.
	if _, err := b.Handoff(); err != nil {
		t.Fatal(err)
	}
	c := fileStore(t, path)
	var notes []string
	if err := c.Claim(ClaimOptions{Notify: func(s string) { notes = append(notes, s) }}); err != nil {
		t.Fatalf("claim of a stale mark: %v", err)
	}
	if len(notes) != 2 {
		t.Fatalf("notes %q: want a wait and a takeover", notes)
	}
	// --force over a live owner: the owner fences itself at its next heartbeat.
	d := fileStore(t, path)
	defer d.Close()
	if err := d.Claim(ClaimOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for c.Fenced() == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := c.WriteAt(make([]byte, 4096), 65536); !errors.Is(err, ErrTakenOver) {
		t.Fatalf("write of a taken-over Store: %v", err)
	}
	if err := c.Sync(); !errors.Is(err, ErrTakenOver) {
		t.Fatalf("sync of a taken-over Store: %v", err)
	}
	c.Close() // must not clear d's mark
	if m, _ := d.readMark(); m.State != Held || m.Instance != d.mark.Instance {
		t.Fatalf("the fenced Store's Close touched the new owner's mark: %+v", m)
	}
	if _, err := d.WriteAt(make([]byte, 4096), 65536); err != nil {
		t.Fatalf("the new owner cannot write: %v", err)
	}
}

func TestAdopt(t *testing.T) {
	path := newExport(t)
	a := fileStore(t, path)
	if err := a.Claim(ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	inst, err := a.Handoff()
	if err != nil {
		t.Fatal(err)
	}
	b := fileStore(t, path)
	defer b.Close()
	if err := b.Adopt("00112233445566778899aabbccddeeff"); err == nil {
		t.Fatal("adopted a claim of another instance")
	}
	if err := b.Adopt(inst); err != nil {
		t.Fatal(err)
	}
	if b.Instance() != inst {
		t.Fatalf("instance %s, want %s", b.Instance(), inst)
	}
}

package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeFlushed writes a sector's worth of fill at off through eli's export and flushes.
func (e *env) writeFlushed(img string, off int64, fill byte) {
	e.t.Helper()
	c := dial(e.t, e.attach(img))
	if err := c.WriteAt(bytes.Repeat([]byte{fill}, 4096), off, false); err != nil {
		e.t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		e.t.Fatal(err)
	}
	c.Close()
	e.OK("detach", filepath.Base(img))
}

func (e *env) readSector(img string, off int64) []byte {
	e.t.Helper()
	c := dial(e.t, e.attach(img, "--readonly"))
	b := make([]byte, 4096)
	if err := c.ReadAt(b, off); err != nil {
		e.t.Fatal(err)
	}
	c.Close()
	e.OK("detach", filepath.Base(img))
	return b
}

// witnessFile is the one witness the test's volume has.
func (e *env) witnessFile() string {
	e.t.Helper()
	m, err := filepath.Glob(filepath.Join(e.Witness, "*"))
	if err != nil || len(m) != 1 {
		e.t.Fatalf("witness files: %v %v", m, err)
	}
	return m[0]
}

// TestWitnessRefusesRollback: a whole-provider rollback (an older image put back) is
// consistent in itself; the witness outside the provider refuses it at attach, and
// --accept-rollback takes it knowingly.
func TestWitnessRefusesRollback(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("w.img", "16M")
	e.writeFlushed(img, 0, 'a')
	old, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	wpath := e.witnessFile()
	oldWitness, err := os.ReadFile(wpath)
	if err != nil {
		t.Fatal(err)
	}
	e.writeFlushed(img, 0, 'b')

	// The attacker puts the old image back.
	if err := os.WriteFile(img, old, 0o600); err != nil {
		t.Fatal(err)
	}
	r := e.FailsCode(1, "older than its witness", "attach", "--passphrase-file", e.Pass, img)
	if !strings.Contains(r.Stderr, "--accept-rollback") || !strings.Contains(r.Stderr, wpath) {
		t.Errorf("refused rollback does not say what to do:\n%s", r.Stderr)
	}
	if out := e.OK("list").Stdout; strings.Contains(out, "w.img") {
		t.Fatalf("a refused attach left the volume attached:\n%s", out)
	}
	// Taken knowingly: the old data, and the witness follows the provider.
	e.OK("attach", "--passphrase-file", e.Pass, "--accept-rollback", img)
	e.OK("detach", "w.img")
	if got := e.readSector(img, 0); got[0] != 'a' {
		t.Fatalf("after the accepted rollback sector 0 holds %q, want the old 'a'", got[0])
	}

	// A witness that lags the provider (a crash between the provider's flush and the
	// witness's update) is moved forward, not refused.
	e.writeFlushed(img, 0, 'c')
	if err := os.WriteFile(wpath, oldWitness, 0o600); err != nil {
		t.Fatal(err)
	}
	if got := e.readSector(img, 0); got[0] != 'c' {
		t.Fatalf("sector 0 holds %q, want 'c'", got[0])
	}
	if now, _ := os.ReadFile(wpath); bytes.Equal(now, oldWitness) {
		t.Error("the witness did not move forward to the newer provider")
	}
}

// TestWitnessDamagedOrForeign: a witness that cannot be read, or that names another
// volume or another root at the same generation, refuses the attach with what to do.
func TestWitnessDamagedOrForeign(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("w.img", "16M")
	e.writeFlushed(img, 0, 'a')
	wpath := e.witnessFile()
	good, err := os.ReadFile(wpath)
	if err != nil {
		t.Fatal(err)
	}
	var rec map[string]any
	if err := json.Unmarshal(good, &rec); err != nil {
		t.Fatal(err)
	}
	edit := func(k string, v any) []byte {
		m := map[string]any{}
		for k, v := range rec {
			m[k] = v
		}
		m[k] = v
		b, _ := json.Marshal(m)
		return b
	}
	for _, tc := range []struct {
		name, want string
		content    []byte
	}{
		{"damaged", "is damaged (invalid character 'n' looking for beginning of object key string): remove it to trust the provider as it is", []byte("{not json")},
		{"another volume", "belongs to volume " + strings.Repeat("ab", 16) + ", not this one: give this volume's with --witness", edit("volume_id", strings.Repeat("ab", 16))},
		{"a fork", "another root", edit("root", strings.Repeat("01", 32))},
	} {
		if err := os.WriteFile(wpath, tc.content, 0o600); err != nil {
			t.Fatal(err)
		}
		e.FailsCode(1, tc.want, "attach", "--passphrase-file", e.Pass, img)
	}
	if err := os.WriteFile(wpath, good, 0o600); err != nil {
		t.Fatal(err)
	}
	e.attach(img)
	e.OK("detach", "w.img")

	// --witness puts it elsewhere; a version 1 volume has none and says so.
	other := e.Path("elsewhere.witness")
	e.attach(img, "--witness", other)
	e.OK("detach", "w.img")
	if _, err := os.Stat(other); err != nil {
		t.Fatalf("--witness %s: %v", other, err)
	}
	v1 := e.initVolume("v1.img", "16M", "--format", "1")
	r := e.OK("attach", "--passphrase-file", e.Pass, "--witness", other, v1)
	if !strings.Contains(r.Stderr, "no generation to witness") {
		t.Errorf("attach --witness of a version 1 volume: %v", r)
	}
	e.OK("detach", "v1.img")
}

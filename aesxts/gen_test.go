package aesxts

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// TestGeneratedAssemblyUpToDate regenerates aesxts_amd64.s with _asm and compares it
// with the checked-in file, so that the generator and its output cannot drift apart.
func TestGeneratedAssemblyUpToDate(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the generator; skipped with -short")
	}
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			t.Skip("no go command to run the generator with")
		}
	}
	out := filepath.Join(t.TempDir(), "aesxts_amd64.s")
	cmd := exec.Command(goBin, "run", ".", "-out", out)
	cmd.Dir = "_asm"
	if msg, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("running the generator: %v\n%s", err, msg)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile("aesxts_amd64.s")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("aesxts_amd64.s differs from the generator's output: run `go generate ./aesxts`")
	}
}

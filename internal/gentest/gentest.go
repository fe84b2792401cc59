// Package gentest checks that generated assembly matches its generator, so that the
// generator (a program in the package's _asm directory, with its own go.mod) and the
// checked-in output cannot drift apart.
package gentest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// UpToDate runs the generator in ./_asm with `-out FILE` and compares its output with
// the checked-in file asm (in the calling package's directory). regenerate is the
// command that fixes a mismatch, for the failure message.
func UpToDate(t *testing.T, asm, regenerate string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs the generator; skipped with -short")
	}
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			t.Fatal("no go command to run the generator with")
		}
	}
	out := filepath.Join(t.TempDir(), asm)
	cmd := exec.Command(goBin, "run", ".", "-out", out)
	cmd.Dir = "_asm"
	if msg, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("running the generator: %v\n%s", err, msg)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile(asm)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from the generator's output: run `%s`", asm, regenerate)
	}
}

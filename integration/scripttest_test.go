package integration

import (
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

// TestScriptRunsEveryStep: scripts/test runs every step even when one fails, names the
// steps that failed at the end, and exits non-zero (issue 38: a failing unit test had
// stopped the script before the integration tests ran). The script runs in a copy of the
// repository's layout with a fake go that fails the unit step and logs every call, and
// a VM directory that already holds a kernel, so that nothing is installed or fetched.
func TestScriptRunsEveryStep(t *testing.T) {
	t.Parallel()
	script, err := os.ReadFile("../scripts/test")
	if err != nil {
		t.Fatal(err)
	}
	// Every tool the script checks for must be here, or it would try to install it.
	for _, line := range strings.Split(string(script), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "need" {
			testtool.Need(t, f[1], f[2])
		}
	}
	testtool.NeedPythonNBD(t)
	root := t.TempDir()
	for _, d := range []string{"scripts", "integration", "bin", "vm/linux-fake"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(name, content string, mode os.FileMode) {
		if err := os.WriteFile(filepath.Join(root, name), []byte(content), mode); err != nil {
			t.Fatal(err)
		}
	}
	write("scripts/test", string(script), 0o755)
	write("integration/x_test.go", "package integration\n", 0o644)
	// A complete VM cache: the kernel, its uncompressed twin, every module tree and list
	// the script looks for, and sysvm's root file system under the name the script
	// computes from the files that make it.
	write("vm/linux-fake/vmlinuz", "", 0o644)
	write("vm/linux-fake/vmlinux", "", 0o644)
	for _, list := range []string{"kpaths", "kfiles"} {
		m := regexp.MustCompile(`(?m)^` + list + `="([^"]*)"`).FindStringSubmatch(string(script))
		if m == nil {
			t.Fatalf("scripts/test sets no %s", list)
		}
		for _, p := range strings.Fields(m[1]) {
			if list == "kpaths" {
				p = "kernel/" + p
			}
			if err := os.MkdirAll(filepath.Join(root, "vm/linux-fake", filepath.Dir(p)), 0o755); err != nil {
				t.Fatal(err)
			}
			write("vm/linux-fake/"+p, "", 0o644)
		}
	}
	if err := os.MkdirAll(filepath.Join(root, "integration/sysvm"), 0o755); err != nil {
		t.Fatal(err)
	}
	key := sha256.New()
	for _, f := range []string{"sysvm/rootfs.packages", "sysvm/mkrootfs.sh"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		key.Write(b)
		write("integration/"+f, string(b), 0o755)
	}
	write(fmt.Sprintf("vm/debian-bookworm-%x.tar", key.Sum(nil)[:8]), "", 0o644)
	log := filepath.Join(root, "go.log")
	// The fake go: "list" prints one package; "test -race" (the unit step) fails.
	write("bin/go", `#!/bin/sh
echo "$*" >> `+log+`
case "$1" in
list) echo example.com/pkg ;;
test) case "$*" in *-race*) echo "FAIL example.com/pkg"; exit 1 ;; esac ;;
esac
exit 0
`, 0o755)
	cmd := exec.Command(filepath.Join(root, "scripts/test"))
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "PATH="+filepath.Join(root, "bin")+":"+os.Getenv("PATH"), "ELI_VM_DIR="+filepath.Join(root, "vm"))
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("scripts/test exited 0 with a failing unit step:\n%s", out)
	}
	calls, rerr := os.ReadFile(log)
	if rerr != nil {
		t.Fatal(rerr)
	}
	if !strings.Contains(string(calls), "./integration/...") {
		t.Fatalf("the integration step did not run after the unit step failed; go was called with:\n%s\noutput:\n%s", calls, out)
	}
	if !strings.Contains(string(out), "go test -race (unit)") || !strings.Contains(string(out), "step(s) failed") {
		t.Fatalf("the summary does not name the failed step:\n%s", out)
	}
	if strings.Contains(string(out), "all tests passed") {
		t.Fatalf("the script says all tests passed:\n%s", out)
	}
}

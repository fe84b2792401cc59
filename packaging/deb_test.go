package packaging

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

// TestDebianPackage builds the package with scripts/deb, checks what it holds, installs
// it into a scratch root with dpkg, runs the installed generator on a table and checks
// its units and the installed targets with systemd-analyze, and removes it again.
func TestDebianPackage(t *testing.T) {
	testtool.Need(t, "dpkg-deb", "dpkg")
	testtool.Need(t, "dpkg", "dpkg")
	analyze := testtool.Need(t, "systemd-analyze", "systemd")
	testtool.NeedRoot(t) // dpkg installs as root, even into a scratch root

	out := t.TempDir()
	build := exec.Command("../scripts/deb", out)
	build.Env = append(os.Environ(), "ELI_VERSION=1.2.3~test")
	var stderr strings.Builder
	build.Stderr = &stderr
	stdout, err := build.Output()
	if err != nil {
		t.Fatalf("scripts/deb: %v\n%s", err, stderr.String())
	}
	deb := strings.TrimSpace(string(stdout))
	if filepath.Base(deb) != "eli_1.2.3~test_amd64.deb" && !strings.HasPrefix(filepath.Base(deb), "eli_1.2.3~test_") {
		t.Fatalf("scripts/deb made %q", deb)
	}

	list, err := exec.Command("dpkg-deb", "-c", deb).Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"./usr/lib/systemd/system-generators/eli-generator -> ../../../sbin/eli",
		"./usr/lib/systemd/system/eli.target", "./usr/lib/systemd/system/remote-eli.target",
		"./usr/lib/systemd/system/sysinit.target.wants/eli.target -> ../eli.target",
		"./usr/lib/systemd/system/remote-fs.target.wants/remote-eli.target -> ../remote-eli.target",
		"./usr/lib/udev/rules.d/60-eli.rules",
		"./usr/share/man/man8/eli.8.gz", "./usr/share/man/man8/eli-attach.8.gz", "./usr/share/man/man5/elitab.5.gz",
		"./usr/share/bash-completion/completions/eli", "./usr/share/zsh/vendor-completions/_eli",
		"./usr/share/fish/vendor_completions.d/eli.fish",
		"./usr/share/doc/eli/copyright", "./usr/share/doc/eli/README.md", "./usr/share/doc/eli/examples/elitab",
		"./etc/elitab",
	} {
		if !hasLineEnding(string(list), " "+want) {
			t.Errorf("the package lacks %s", want)
		}
	}
	if !hasLineEnding(string(list), "") || !strings.Contains(string(list), "-rwxr-xr-x root/root") {
		t.Errorf("no executable in the package:\n%s", list)
	}
	for field, want := range map[string]string{"Package": "eli", "Version": "1.2.3~test", "Section": "admin"} {
		got, err := exec.Command("dpkg-deb", "-f", deb, field).Output()
		if err != nil || strings.TrimSpace(string(got)) != want {
			t.Errorf("control field %s = %q, %v; want %q", field, got, err, want)
		}
	}
	if conf, _ := exec.Command("dpkg-deb", "--ctrl-tarfile", deb).Output(); !strings.Contains(string(conf), "conffiles") {
		t.Error("no conffiles: /etc/elitab would be overwritten on upgrade")
	}

	root := t.TempDir()
	for _, d := range []string{"var/lib/dpkg/info", "var/lib/dpkg/updates"} {
		os.MkdirAll(filepath.Join(root, d), 0o755)
	}
	os.WriteFile(filepath.Join(root, "var/lib/dpkg/status"), nil, 0o644)
	dpkg := func(args ...string) {
		t.Helper()
		// Without a chroot: the scratch root has no shell for the maintainer scripts,
		// which skip their work when DPKG_ROOT is set.
		cmd := exec.Command("dpkg", append([]string{"--root=" + root, "--force-script-chrootless", "--log=/dev/null"}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("dpkg %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	dpkg("-i", deb)
	if v, err := exec.Command(filepath.Join(root, "usr/sbin/eli"), "version").Output(); err != nil || !strings.HasPrefix(string(v), "eli 1.2.3~test ") {
		t.Errorf("installed eli version: %q, %v", v, err)
	}
	units := t.TempDir()
	gen := exec.Command(filepath.Join(root, "usr/lib/systemd/system-generators/eli-generator"), units)
	gen.Env = append(os.Environ(), "ELI_ELITAB="+filepath.Join("..", "generator", "testdata", "elitab"))
	if out, err := gen.CombinedOutput(); err != nil || len(out) > 0 {
		t.Fatalf("installed generator: %v\n%s", err, out)
	}
	unit, err := os.ReadFile(filepath.Join(units, "eli@data.service"))
	if err != nil || !strings.Contains(string(unit), "ExecStart="+filepath.Join(root, "usr/sbin/eli")+" attach --foreground") {
		t.Fatalf("the installed generator's unit runs another binary: %v\n%s", err, unit)
	}
	// The generated units with the installed targets, as systemd would load them.
	for _, target := range []string{"eli.target", "remote-eli.target"} {
		data, err := os.ReadFile(filepath.Join(root, "usr/lib/systemd/system", target))
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(units, target), data, 0o644)
	}
	for _, u := range []string{"nbdkit-disk.service", "backup.service"} { // the table's x-systemd.* units
		os.WriteFile(filepath.Join(units, u), []byte("[Service]\nExecStart=/bin/true\n"), 0o644)
	}
	verify := []string{"verify", "--man=no", filepath.Join(units, "eli.target"), filepath.Join(units, "remote-eli.target")}
	ents, _ := os.ReadDir(units)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "eli@") {
			verify = append(verify, filepath.Join(units, e.Name()))
		}
	}
	if out, err := exec.Command(analyze, verify...).CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify of the installed package's units: %v\n%s", err, out)
	}

	dpkg("--purge", "eli")
	for _, p := range []string{"usr/sbin/eli", "etc/elitab", "usr/lib/udev/rules.d/60-eli.rules"} {
		if _, err := os.Lstat(filepath.Join(root, p)); !os.IsNotExist(err) {
			t.Errorf("%s survived the purge: %v", p, err)
		}
	}
}

func hasLineEnding(text, suffix string) bool {
	for _, line := range strings.Split(text, "\n") {
		if line != "" && strings.HasSuffix(line, suffix) {
			return true
		}
	}
	return false
}

package generator

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/elidisk/eli/elitab"
	"github.com/elidisk/eli/internal/testtool"
	"github.com/elidisk/eli/keysource"
)

var update = flag.Bool("update", false, "rewrite the golden files")

func readTable(t *testing.T) []elitab.Volume {
	t.Helper()
	vols, errs, err := elitab.ReadFile("testdata/elitab")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range errs {
		t.Error(e)
	}
	return vols
}

// render spells files as one text: each file under a "== NAME" line, a link as
// "== NAME -> TARGET".
func render(files []File) string {
	var b strings.Builder
	for _, f := range files {
		if f.Link != "" {
			fmt.Fprintf(&b, "== %s -> %s\n", f.Name, f.Link)
			continue
		}
		fmt.Fprintf(&b, "== %s\n%s", f.Name, f.Data)
	}
	return b.String()
}

func TestGolden(t *testing.T) {
	t.Parallel()
	got := render(Units(Config{Eli: "/usr/sbin/eli", Source: "/etc/elitab"}, readTable(t)))
	golden := "testdata/units.golden"
	if *update {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Errorf("the generator's output differs from %s (go test -update rewrites it):\n%s", golden, got)
	}
}

// TestEscapeLikeSystemd checks the unit name escaping against systemd-escape itself.
func TestEscapeLikeSystemd(t *testing.T) {
	t.Parallel()
	prog := testtool.Need(t, "systemd-escape", "systemd")
	for _, s := range []string{"data", "local-nbd", "a+b.c_d", ".hidden", "é", "x:y", "back\\slash", "sp ace"} {
		out, err := exec.Command(prog, "--", s).Output()
		if err != nil {
			t.Fatal(err)
		}
		if want := strings.TrimSpace(string(out)); EscapeName(s) != want {
			t.Errorf("EscapeName(%q) = %q, systemd-escape says %q", s, EscapeName(s), want)
		}
	}
	for _, p := range []string{"/dev/eli/data", "/dev/disk/by-id/ata-DISK_1234-part2", "/dev/eli/local-nbd", "/", "/srv/x/y/", "/dev/.x"} {
		out, err := exec.Command(prog, "--path", "--", p).Output()
		if err != nil {
			t.Fatal(err)
		}
		if want := strings.TrimSpace(string(out)); EscapePath(p) != want {
			t.Errorf("EscapePath(%q) = %q, systemd-escape --path says %q", p, EscapePath(p), want)
		}
	}
}

// TestExecLineRoundTrip: what ExecStart= says is what eli gets, and the key command in
// it splits back into the table's argv.
func TestExecLineRoundTrip(t *testing.T) {
	t.Parallel()
	for _, v := range readTable(t) {
		argv := append([]string{"/usr/sbin/eli"}, attachArgs(v)...)
		got := systemdSplit(t, execLine(argv))
		if strings.Join(got, "\x00") != strings.Join(argv, "\x00") {
			t.Errorf("%s: ExecStart=%s\nsplits into %q\nwant %q", v.Name, execLine(argv), got, argv)
		}
		if v.Key.Kind == elitab.KeyCommand {
			i := indexOf(got, "--key-command")
			cmd, err := keysource.SplitCommand(got[i+1])
			if err != nil || strings.Join(cmd, "\x00") != strings.Join(v.Key.Command, "\x00") {
				t.Errorf("%s: --key-command %q splits into %q, %v; want %q", v.Name, got[i+1], cmd, err, v.Key.Command)
			}
		}
	}
}

func indexOf(s []string, x string) int {
	for i, e := range s {
		if e == x {
			return i
		}
	}
	return -1
}

// systemdSplit undoes execLine as systemd reads ExecStart=: specifiers and variables
// first ('%%' and '$$'), then words in double quotes with C escapes.
func systemdSplit(t *testing.T, s string) []string {
	t.Helper()
	var words []string
	var w strings.Builder
	in, quoted := false, false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case (c == '%' || c == '$') && i+1 < len(s) && s[i+1] == c:
			w.WriteByte(c)
			i++
			in = true
		case c == '%' || c == '$':
			t.Fatalf("unescaped %c in %q", c, s)
		case c == '"':
			quoted, in = !quoted, true
		case c == '\\' && quoted:
			i++
			w.WriteByte(s[i])
		case c == ' ' && !quoted:
			if in {
				words = append(words, w.String())
				w.Reset()
				in = false
			}
		default:
			w.WriteByte(c)
			in = true
		}
	}
	if in {
		words = append(words, w.String())
	}
	return words
}

// TestSystemdAnalyzeVerify loads the generated units, with the targets the package
// installs, into systemd's own unit parser: any warning fails the test.
func TestSystemdAnalyzeVerify(t *testing.T) {
	t.Parallel()
	prog := testtool.Need(t, "systemd-analyze", "systemd")
	dir := t.TempDir()
	self, err := os.Executable() // an executable that exists, for ExecStart=
	if err != nil {
		t.Fatal(err)
	}
	files := Units(Config{Eli: self, Source: "/etc/elitab"}, readTable(t))
	if err := Write(dir, files); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{LocalTarget, RemoteTarget} {
		data, err := os.ReadFile(filepath.Join("..", "packaging", "systemd", target))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, target), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// Units the table's x-systemd.* options name, which this machine lacks.
	for _, u := range []string{"nbdkit-disk.service", "backup.service"} {
		os.WriteFile(filepath.Join(dir, u), []byte("[Service]\nExecStart="+self+"\n"), 0o644)
	}
	var units []string
	for _, f := range files {
		if f.Link == "" && !strings.Contains(f.Name, "/") {
			units = append(units, filepath.Join(dir, f.Name))
		}
	}
	units = append(units, filepath.Join(dir, LocalTarget), filepath.Join(dir, RemoteTarget))
	sort.Strings(units)
	cmd := exec.Command(prog, append([]string{"verify", "--man=no"}, units...)...)
	out, err := cmd.CombinedOutput()
	if err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	if len(units) < 9 {
		t.Errorf("verified %d units; the table has 8 volumes", len(units))
	}
}

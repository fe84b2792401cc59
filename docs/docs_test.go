// Package docs holds eli's documentation; its test keeps the documents honest.
package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// refRE finds test references: `blockdev/crash_test.go: TestCrashConsistency` names a
// file and a test; a bare `TestOther` after it names another test of the same file.
var refRE = regexp.MustCompile("`(?:([a-z0-9_/]+_test\\.go): )?((?:Test|Fuzz)[A-Za-z0-9_]+)`")

// TestReferencedTestsExist checks that every test a document cites exists in the file it
// names, so that a renamed or deleted test cannot leave a claim without its proof.
func TestReferencedTestsExist(t *testing.T) {
	for _, doc := range []string{"threat-model.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(strings.Fields(string(b)), " ") // references may wrap lines
		file, refs := "", 0
		for _, m := range refRE.FindAllStringSubmatch(text, -1) {
			if m[1] != "" {
				file = m[1]
			}
			if file == "" {
				t.Errorf("%s cites %s before naming any test file", doc, m[2])
				continue
			}
			refs++
			src, err := os.ReadFile(filepath.Join("..", file))
			if err != nil {
				t.Errorf("%s cites %s: %v", doc, file, err)
				continue
			}
			if !regexp.MustCompile(`(?m)^func ` + m[2] + `\(`).Match(src) {
				t.Errorf("%s cites %s: %s, which is not in that file", doc, file, m[2])
			}
		}
		if refs < 30 {
			t.Errorf("%s: only %d test references found; the parser or the document changed", doc, refs)
		}
	}
}

// TestStandsAlone checks that the repository's documents and code point at nothing outside
// it, and that every relative link in a document resolves: what the repository needs of a
// design note belongs in docs/design.md.
func TestStandsAlone(t *testing.T) {
	linkRE := regexp.MustCompile(`\]\(([^)#\s]+)(#[^)]*)?\)`)
	err := filepath.WalkDir("..", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); name == ".git" || name == "testdata" {
				return filepath.SkipDir
			}
			return nil
		}
		ext := filepath.Ext(path)
		if ext != ".md" && ext != ".go" {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		text := string(b)
		if filepath.Base(path) != "docs_test.go" && (strings.Contains(text, "../shared") || strings.Contains(text, "DESIGN.md")) {
			t.Errorf("%s points outside the repository (../shared or DESIGN.md): use docs/design.md", path)
		}
		if ext != ".md" {
			return nil
		}
		for _, m := range linkRE.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			if _, err := os.Stat(filepath.Join(filepath.Dir(path), target)); err != nil {
				t.Errorf("%s links to %s, which does not exist", path, target)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

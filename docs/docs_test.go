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

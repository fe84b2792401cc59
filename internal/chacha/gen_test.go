package chacha

import (
	"testing"

	"github.com/elidisk/eli/internal/gentest"
)

// TestGeneratedAssemblyUpToDate: chacha_amd64.s is what _asm generates.
func TestGeneratedAssemblyUpToDate(t *testing.T) {
	gentest.UpToDate(t, "chacha_amd64.s", "go generate ./internal/chacha")
}

package poly1305

import (
	"testing"

	"github.com/elidisk/eli/internal/gentest"
)

// TestGeneratedAssemblyUpToDate: poly1305_amd64.s is what _asm generates.
func TestGeneratedAssemblyUpToDate(t *testing.T) {
	gentest.UpToDate(t, "poly1305_amd64.s", "go generate ./internal/poly1305")
}

package aesxts

import (
	"testing"

	"github.com/elidisk/eli/internal/gentest"
)

// TestGeneratedAssemblyUpToDate: aesxts_amd64.s is what _asm generates.
func TestGeneratedAssemblyUpToDate(t *testing.T) {
	gentest.UpToDate(t, "aesxts_amd64.s", "go generate ./internal/aesxts")
}

package sector

import (
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/poly1305"
)

// TestImplementation: every mode names its code, and xchacha20-poly1305 names the path
// the codec really takes.
func TestImplementation(t *testing.T) {
	t.Parallel()
	for _, m := range Modes() {
		if got := Implementation(m); got == "" || strings.HasPrefix(got, "none:") {
			t.Errorf("%s: implementation %q", m, got)
		}
	}
	c := newTestAEAD(t, 4096, testVol).(*aeadCodec)
	if own := strings.Contains(Implementation(ModeXChaCha20Poly1305), "poly1305 (avx512-ifma)"); own != c.fast || c.fast != poly1305.Accelerated() {
		t.Errorf("Implementation says own code %v, the codec's fast path is %v", own, c.fast)
	}
	if got := Implementation(Mode(200)); !strings.HasPrefix(got, "none:") {
		t.Errorf("an invalid mode: %q", got)
	}
}

package sector

import (
	"github.com/elidisk/eli/internal/aesxts"
	"github.com/elidisk/eli/internal/chacha"
	"github.com/elidisk/eli/internal/poly1305"
)

// Implementation names the code that runs mode m's codec in this process, for `eli
// version` and bug reports: the bytes never depend on it (every path is tested against
// the others), the speed does.
func Implementation(m Mode) string {
	switch m {
	case ModeXChaCha20Poly1305:
		if poly1305.Accelerated() {
			return "eli chacha (" + chacha.Implementation() + ") + poly1305 (avx512-ifma) for runs, x/crypto for lone sectors"
		}
		return "x/crypto chacha20poly1305"
	case ModeAESXTS256, ModeAESXTS128:
		return "eli aesxts (" + aesxts.Implementation() + ")"
	case ModeChaCha20XTS, ModeChaCha12XTS, ModeChaCha8XTS,
		ModeXChaCha20XTS, ModeXChaCha12XTS, ModeXChaCha8XTS:
		return "eli chacha (" + chacha.Implementation() + ")"
	case ModeNone:
		return "copy"
	}
	return "none: not a mode"
}

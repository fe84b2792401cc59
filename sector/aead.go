package sector

import "errors"

// TODO(issue 4): the XChaCha20-Poly1305 codec.
func newAEAD(p Params) (Codec, error) {
	return nil, errors.New("sector: xchacha20-poly1305 not built yet")
}

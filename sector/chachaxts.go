package sector

import "errors"

// TODO(issue 5): the unsafe ChaCha "XTS" modes.
func newChaChaXTS(p Params) (Codec, error) {
	return nil, errors.New("sector: chacha xts not built yet")
}

package sector

import "errors"

// TODO(issue 5): AES-XTS.
func newAESXTS(p Params) (Codec, error) { return nil, errors.New("sector: aes-xts not built yet") }

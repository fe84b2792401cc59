//go:build amd64 && !purego

package poly1305

import "golang.org/x/crypto/poly1305"

// sumRaw is Poly1305 of a raw message (RFC 8439 §2.5) with path p, for the RFC's
// vectors, which are not all AEAD inputs. The IFMA path runs the kernel over the whole
// eight-block runs and the scalar code over the rest, the final partial block padded
// with 0x01 and zeros and without the 2^128 bit (RFC 8439 §2.5.1).
func sumRaw(p path, tag *[16]byte, key *[32]byte, msg []byte) {
	if p != pathIFMA {
		poly1305.Sum(tag, msg, key)
		return
	}
	var s state
	s.init(key)
	if n := len(msg) &^ 127; n > 0 {
		s.vector(msg[:n])
		msg = msg[n:]
	}
	full := len(msg) &^ 15
	s.blocks(msg[:full], 1)
	if rest := msg[full:]; len(rest) > 0 {
		var b [16]byte
		copy(b[:], rest)
		b[len(rest)] = 1
		s.blocks(b[:], 0)
	}
	s.finish(tag, key)
}

//go:build !amd64 || purego

package aesxts

var defaultEngine = engineGeneric

func engines() []engine { return []engine{engineGeneric} }

// expandKeys is never called: the only engine here is the generic one.
func (c *Cipher) expandKeys([]byte) { panic("aesxts: no assembly engine in this build") }

func (c *Cipher) crypt(dst, src []byte, unit int, first uint64, decrypt bool) {
	c.cryptGeneric(dst, src, unit, first, decrypt)
}

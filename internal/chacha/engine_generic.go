//go:build !amd64 || purego

package chacha

var defaultEngine = engineGeneric

func engines() []engine { return []engine{engineGeneric} }

func xorKeyStream(_ engine, st *[16]uint32, rounds int, ctr64 bool, dst, src []byte) {
	xorGeneric(st, rounds, ctr64, dst, src)
}

func hchachaEngine(_ engine, st *[16]uint32, rounds int) [8]uint32 {
	return hchachaGeneric(st, rounds)
}

func hchachaManyEngine(_ engine, st *[16]uint32, rounds int, nonces, out []byte) {
	hchachaManyGeneric(st, rounds, nonces, out)
}

func firstBlocks(_ engine, in *[16][16]uint32, out *[8][16]uint32, lanes, rounds int) {
	firstBlocksGeneric(in, out, lanes, rounds)
}

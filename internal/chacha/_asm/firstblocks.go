package main

// firstBlocksAVX512: block 0 of 16 different ChaCha states at once, one per 32-bit lane,
// for XChaCha20-Poly1305 over runs of sectors: every sector has its own subkey and nonce,
// and the first 32 bytes of its block 0 are its Poly1305 key (RFC 8439 §2.6). One block
// alone is a long dependency chain; in lanes sixteen cost about what one does.
//
//	func firstBlocksAVX512(in *[16][16]uint32, out *[8][16]uint32, rounds int)
//
// in is word-sliced: in[w][l] is word w of lane l's state. out[w][l] receives word w
// (0..7) of lane l's keystream block, that is of the permuted state plus the input. The
// Go caller does the slicing and unslicing: 16 states are a few hundred bytes, and plain
// moves there keep this kernel free of transposes.
func (g *gen) firstBlocks(name string) {
	g.line("// func %s(in *[16][16]uint32, out *[8][16]uint32, rounds int)", name)
	g.line("TEXT ·%s(SB), NOSPLIT, $0-24", name)
	g.op("MOVQ in+0(FP), AX")
	g.op("MOVQ out+8(FP), DI")
	g.op("MOVQ rounds+16(FP), DX")
	g.op("SHRQ $1, DX") // double rounds
	r := func(i int) string { return reg("Z", i) }
	for i := 0; i < 16; i++ {
		g.op("VMOVDQU32 %d(AX), %s", 64*i, r(i))
	}
	g.line("%s_round:", name)
	g.doubleRoundEVEX(r)
	g.op("DECQ DX")
	g.op("JNZ %s_round", name)
	for i := 0; i < 8; i++ {
		g.op("VPADDD %d(AX), %s, %s", 64*i, r(i), r(i))
		g.op("VMOVDQU32 %s, %d(DI)", r(i), 64*i)
	}
	// The upper words hold the rest of the keystream block and the subkeys' mixing.
	g.wipeRet(true, 0)
	g.line("")
}

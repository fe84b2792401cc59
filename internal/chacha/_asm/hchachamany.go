package main

// The batch HChaCha kernels: one nonce per 32-bit lane, the word-sliced layout of the
// block kernels, so a pass over 16 (ZMM) or 8 (YMM) nonces costs about what one
// 16- or 8-block keystream chunk costs, instead of one long dependency chain per nonce.
//
//	func name(st *[16]uint32, nonces, out *byte, n int, rounds int)
//
// st holds the constants and the key (words 0..11; 12..15 are ignored). nonces is n
// 16-byte nonces back to back, out receives n 32-byte subkeys (words 0..3 and 12..15
// of the permuted state, little-endian); n is a positive multiple of the lane count.
//
// Loading: with nonces 4j..4j+3 (ZMM) or 2j, 2j+1 (YMM) in register j, one 128-bit lane
// per nonce, a 4×4 transpose inside each 128-bit lane (transpose4) leaves register k
// holding word k of every nonce, though not in nonce order: element m of lane L is nonce
// 4m+L (ZMM) or 2m+L (YMM). Lanes never interact, so the rounds do not care; the same
// transpose on the way out puts words 0..3 (and 12..15) of nonce 4k+L (2k+L) back in lane
// L of register k, which is then interleaved with its words 12..15 and stored.

// hchachaManyEVEX emits the AVX-512 kernel: ZMM registers for 16 lanes, or YMM registers
// with AVX-512VL (VPROLD, and registers 16..31 for the transposes) for 8.
func (g *gen) hchachaManyEVEX(name string, lanes int) {
	p := "Z"
	if lanes == 8 {
		p = "Y"
	}
	r := func(i int) string { return reg(p, i) }
	g.line("// func %s(st *[16]uint32, nonces, out *byte, n int, rounds int)", name)
	g.line("TEXT ·%s(SB), NOSPLIT, $0-40", name)
	g.hchachaManyArgs()
	g.line("%s_step:", name)
	for j := 0; j < 4; j++ {
		g.op("VMOVDQU32 %d(SI), %s", 4*lanes*j, r(12+j))
	}
	tmp := [4]string{r(16), r(17), r(18), r(19)}
	g.transpose4([4]string{r(12), r(13), r(14), r(15)}, tmp)
	for i := 0; i < 12; i++ {
		g.op("VPBROADCASTD %d(AX), %s", 4*i, r(i))
	}
	g.op("MOVQ DX, R11")
	g.line("%s_round:", name)
	g.doubleRoundEVEX(r)
	g.op("DECQ R11")
	g.op("JNZ %s_round", name)
	g.transpose4([4]string{r(0), r(1), r(2), r(3)}, tmp)
	g.transpose4([4]string{r(12), r(13), r(14), r(15)}, tmp)
	for k := 0; k < 4; k++ {
		u, v := r(k), r(12+k) // lane L: words 0..3 and 12..15 of one nonce
		if lanes == 16 {
			// Nonces 4k..4k+3: u0 v0 u1 v1 and u2 v2 u3 v3.
			g.op("VSHUFI32X4 $0x44, %s, %s, Z16", v, u) // u0 u1 v0 v1
			g.op("VSHUFI32X4 $0xee, %s, %s, Z17", v, u) // u2 u3 v2 v3
			g.op("VSHUFI32X4 $0xd8, Z16, Z16, Z16")     // u0 v0 u1 v1
			g.op("VSHUFI32X4 $0xd8, Z17, Z17, Z17")     // u2 v2 u3 v3
			g.op("VMOVDQU32 Z16, %d(DI)", 128*k)
			g.op("VMOVDQU32 Z17, %d(DI)", 128*k+64)
			continue
		}
		// Nonces 2k, 2k+1: u0 v0 and u1 v1.
		g.op("VSHUFI32X4 $0, %s, %s, Y16", v, u)
		g.op("VSHUFI32X4 $3, %s, %s, Y17", v, u)
		g.op("VMOVDQU32 Y16, %d(DI)", 64*k)
		g.op("VMOVDQU32 Y17, %d(DI)", 64*k+32)
	}
	g.hchachaManyNext(name, lanes, true, 0)
}

// doubleRoundEVEX emits one column round and one diagonal round over the word-sliced
// state in registers r(0)..r(15), with AVX-512's VPROLD for the rotations: the body of
// every kernel that keeps the whole state in registers, one block (or nonce) per lane.
func (g *gen) doubleRoundEVEX(r func(int) string) {
	rot := func(g *gen, x string, n, _ int) { g.op("VPROLD $%d, %s, %s", n, x, x) }
	q := func(a, b, c, d int) quarter { return quarter{r(a), r(b), r(c), r(d)} }
	g.rounds([]quarter{q(0, 4, 8, 12), q(1, 5, 9, 13), q(2, 6, 10, 14), q(3, 7, 11, 15)}, "VPADDD", "VPXORD", rot)
	g.rounds([]quarter{q(0, 5, 10, 15), q(1, 6, 11, 12), q(2, 7, 8, 13), q(3, 4, 9, 14)}, "VPADDD", "VPXORD", rot)
}

// Stack of hchachaManyAVX2, relative to R9 (32-byte aligned): the four "c" words x8..x11
// (two of them in registers at any time, as in xorAVX2).
const hmanyFrame = 4*32 + 32 // + alignment slack

// hchachaManyAVX2 emits the 8-lane AVX2 kernel, with the register plan of xorAVX2:
// Y0..Y7 = x0..x7, Y8, Y9 = two of x8..x11, Y10..Y13 = x12..x15, Y14, Y15 temporaries.
func (g *gen) hchachaManyAVX2(name string) {
	g.line("// func %s(st *[16]uint32, nonces, out *byte, n int, rounds int)", name)
	// Not NOSPLIT, like xorAVX2: the frame is on the goroutine stack, so take the check.
	g.line("TEXT ·%s(SB), 0, $%d-40", name, hmanyFrame)
	g.op("NO_LOCAL_POINTERS")
	g.hchachaManyArgs()
	g.op("MOVQ SP, R9")
	g.op("ADDQ $31, R9")
	g.op("ANDQ $-32, R9")
	g.line("%s_step:", name)
	for j := 0; j < 4; j++ {
		g.op("VMOVDQU %d(SI), Y%d", 32*j, 10+j)
	}
	g.transpose4([4]string{"Y10", "Y11", "Y12", "Y13"}, [4]string{"Y0", "Y1", "Y2", "Y3"})
	for i := 0; i < 10; i++ {
		g.op("VPBROADCASTD %d(AX), Y%d", 4*i, i)
	}
	for i := 10; i < 12; i++ {
		g.op("VPBROADCASTD %d(AX), Y14", 4*i)
		g.op("VMOVDQA Y14, %d(R9)", 32*(i-8))
	}
	g.avx2Rounds(name+"_round", 0)
	g.transpose4([4]string{"Y0", "Y1", "Y2", "Y3"}, [4]string{"Y4", "Y5", "Y6", "Y7"})
	g.transpose4([4]string{"Y10", "Y11", "Y12", "Y13"}, [4]string{"Y4", "Y5", "Y6", "Y7"})
	for k := 0; k < 4; k++ {
		// Nonces 2k, 2k+1: words 0..3 from Yk, 12..15 from Y(10+k), lane by lane.
		g.op("VPERM2I128 $0x20, Y%d, Y%d, Y4", 10+k, k)
		g.op("VPERM2I128 $0x31, Y%d, Y%d, Y5", 10+k, k)
		g.op("VMOVDQU Y4, %d(DI)", 64*k)
		g.op("VMOVDQU Y5, %d(DI)", 64*k+32)
	}
	g.hchachaManyNext(name, 8, false, hmanyFrame-32)
}

func (g *gen) hchachaManyArgs() {
	g.op("MOVQ st+0(FP), AX")
	g.op("MOVQ nonces+8(FP), SI")
	g.op("MOVQ out+16(FP), DI")
	g.op("MOVQ n+24(FP), CX")
	g.op("MOVQ rounds+32(FP), DX")
	g.op("SHRQ $1, DX") // double rounds
}

// hchachaManyNext moves past one step of lanes nonces and loops while nonces remain.
func (g *gen) hchachaManyNext(name string, lanes int, evex bool, frameBytes int) {
	g.op("ADDQ $%d, SI", 16*lanes)
	g.op("ADDQ $%d, DI", 32*lanes)
	g.op("SUBQ $%d, CX", lanes)
	g.op("JNZ %s_step", name)
	g.wipeRet(evex, frameBytes)
	g.line("")
}

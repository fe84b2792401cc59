package main

// vaesWide is the number of ZMM registers of data in flight in the main loop, each four
// blocks: 16 blocks, 256 bytes per step. A VAESENC on a ZMM register has four cycles or
// more of latency on the machines that have it, so four independent registers keep the
// AES units busy, and the out-of-order core overlaps one step's loads and tweaks with
// the previous step's rounds. (Eight registers, which leave no room for the folded last
// key below, were slower per 4 KiB: BenchmarkEngines; docs/benchmarks.md, "Measurements
// behind design choices".)
//
// The unit prologue's shift tables (sllcnt, srlcnt) cover the 16 tweaks of 4 registers.
const vaesWide = 4

// Register plan of the VAES kernels:
//
//	Z0..Z3     data, four blocks each
//	Z4..Z7     tweaks XOR the last round key (see aesni: AESENCLAST folds the XOR in)
//	Z8..Z11    the tweaks of the next 16 blocks, block 4i+j in lane j of Z(8+i)
//	Z12        scratch for advancing the tweaks
//	X13        the next unit's first tweak
//	Z14        the current unit's first tweak in every lane (Z4, Z5: scratch then)
//	Z16..Z30   the round keys, each broadcast to all four lanes
//	Z31        poly: 0x87 in the low 64 bits of every lane
const (
	zData, zLast, zTweak, zKey = 0, 4, 8, 16
	zTmp, xNext                = "Z12", "X13"
	zPoly                      = "Z31"
)

// vaes emits encVAES512 or decVAES512: XTS with VAES on ZMM registers (AVX-512F, BW,
// VL, VAES, VPCLMULQDQ).
func (g *gen) vaes(d direction) {
	name := d.name + "VAES512"
	g.line("// func %s(k, tk *[240]byte, rounds int, dst, src *byte, unit, count int, first uint64)", name)
	g.line("TEXT ·%s(SB), NOSPLIT, $0-%d", name, kernelArgs)
	g.loadArgs()
	g.op("VBROADCASTI32X4 poly<>(SB), %s", zPoly)
	g.op("CMPQ R9, $10")
	g.op("JEQ r10")
	g.vaesBody(d, 14)
	g.label("r10")
	g.vaesBody(d, 10)
	g.line("")
}

func (g *gen) vaesBody(d direction, rounds int) {
	p := reg("r", rounds)
	z := func(base, i int) string { return reg("Z", base+i) }
	round, last := "V"+d.round, "V"+d.lastRound

	g.tweakVEX(rounds)
	for r := 0; r <= rounds; r++ {
		g.op("VBROADCASTI32X4 %d(AX), %s", 16*r, z(zKey, r))
	}

	g.label(p + "unit")
	// The tweaks of the unit's first 16 blocks, Z(8+i) lane j = T·α^(4i+j), straight
	// from T in every lane, shifted by a per-lane count: a few independent instructions
	// rather than a chain, which runs of short units notice (BenchmarkSectors;
	// docs/benchmarks.md, "Measurements behind design choices").
	g.op("VSHUFI64X2 $0, Z13, Z13, Z14") // T in all four lanes
	for i := 0; i < vaesWide; i++ {
		g.op("VPSRLVQ srlcnt<>+%d(SB), Z14, Z4", 64*i)
		g.op("VPCLMULQDQ $0x01, %s, Z4, Z5", zPoly)
		g.op("VPSLLDQ $8, Z4, Z4")
		g.op("VPSLLVQ sllcnt<>+%d(SB), Z14, %s", 64*i, z(zTweak, i))
		g.op("VPTERNLOGQ $0x96, Z4, Z5, %s", z(zTweak, i))
	}
	// The next unit's tweak, if there is one, while this one's blocks run. (Building
	// the next unit's 16 tweaks here too measured slower: the waiting instructions
	// crowd out the blocks'.)
	g.op("CMPQ R12, $1")
	g.op("JEQ %slast", p)
	g.op("INCQ R10")
	g.tweakVEX(rounds)
	g.label(p + "last")
	g.op("MOVQ R8, DX")

	step := 64 * vaesWide
	g.op("CMPQ DX, $%d", step)
	g.op("JB %stail", p)
	g.label(p + "loop")
	for i := 0; i < vaesWide; i++ {
		g.op("VPXORQ %d(SI), %s, %s", 64*i, z(zTweak, i), z(zData, i))
	}
	for i := 0; i < vaesWide; i++ {
		g.op("VPXORQ %s, %s, %s", z(zKey, 0), z(zData, i), z(zData, i))
	}
	for i := 0; i < vaesWide; i++ {
		g.op("VPXORQ %s, %s, %s", z(zKey, rounds), z(zTweak, i), z(zLast, i))
	}
	// The tweaks are used up: advance them by 16 blocks while the rounds run.
	for i := 0; i < vaesWide; i++ {
		g.mulAlpha(z(zTweak, i), z(zTweak, i), 4*vaesWide, zTmp)
	}
	for r := 1; r < rounds; r++ {
		for i := 0; i < vaesWide; i++ {
			g.op("%s %s, %s, %s", round, z(zKey, r), z(zData, i), z(zData, i))
		}
	}
	for i := 0; i < vaesWide; i++ {
		g.op("%s %s, %s, %s", last, z(zLast, i), z(zData, i), z(zData, i))
	}
	for i := 0; i < vaesWide; i++ {
		g.op("VMOVDQU64 %s, %d(DI)", z(zData, i), 64*i)
	}
	g.op("ADDQ $%d, SI", step)
	g.op("ADDQ $%d, DI", step)
	g.op("SUBQ $%d, DX", step)
	g.op("CMPQ DX, $%d", step)
	g.op("JAE %sloop", p)

	// Fewer than 16 blocks left (none for units of whole 256 bytes, as every sector
	// size is): up to four at a time, the last piece through a mask (masked-off lanes
	// are neither read nor written, so nothing past the buffers is touched), taking the
	// waiting tweak registers in turn.
	g.label(p + "tail")
	g.op("TESTQ DX, DX")
	g.op("JZ %snext", p)
	g.label(p + "tailloop")
	g.op("MOVQ $64, R11")
	g.op("CMPQ DX, R11")
	g.op("CMOVQLT DX, R11") // bytes in this piece
	g.op("MOVQ R11, CX")
	g.op("SHRQ $3, CX")
	g.op("MOVL $1, R13")
	g.op("SHLL CX, R13")
	g.op("DECL R13") // one mask bit per 64-bit element
	g.op("KMOVW R13, K1")
	g.op("VMOVDQU64.Z (SI), K1, Z0")
	g.op("VPXORQ %s, Z0, Z0", z(zTweak, 0))
	g.op("VPXORQ %s, Z0, Z0", z(zKey, 0))
	g.op("VPXORQ %s, %s, Z1", z(zKey, rounds), z(zTweak, 0))
	for r := 1; r < rounds; r++ {
		g.op("%s %s, Z0, Z0", round, z(zKey, r))
	}
	g.op("%s Z1, Z0, Z0", last)
	g.op("VMOVDQU64 Z0, K1, (DI)")
	for i := 1; i < vaesWide; i++ {
		g.op("VMOVDQA64 %s, %s", z(zTweak, i), z(zTweak, i-1))
	}
	g.op("ADDQ R11, SI")
	g.op("ADDQ R11, DI")
	g.op("SUBQ R11, DX")
	g.op("JNZ %stailloop", p)

	g.label(p + "next")
	g.op("DECQ R12")
	g.op("JNZ %sunit", p)

	// Round keys and tweaks are secret. VZEROALL clears Z0..Z15 (and restores the
	// zero X15 Go code expects); Z16..Z30 by hand.
	g.op("VZEROALL")
	for r := 0; r <= rounds; r++ {
		g.op("VPXORQ %s, %s, %s", z(zKey, r), z(zKey, r), z(zKey, r))
	}
	g.op("RET")
}

// tweakVEX sets X13 to a unit's first tweak: the block LE128(R10) encrypted with the
// tweak key's schedule at BX (memory operands: VEX has no alignment rule).
func (g *gen) tweakVEX(rounds int) {
	g.op("MOVQ R10, %s", xNext) // zero-extends: the upper 64 bits of the block are zero
	g.op("VPXOR 0(BX), %s, %s", xNext, xNext)
	for r := 1; r < rounds; r++ {
		g.op("VAESENC %d(BX), %s, %s", 16*r, xNext, xNext)
	}
	g.op("VAESENCLAST %d(BX), %s, %s", 16*rounds, xNext, xNext)
}

// mulAlpha sets dst to src·α^k in every 128-bit lane (dst may be src), for k a multiple
// of 8 up to 120; s is scratch. src·x^k = (src << k mod 2^128) ^ top·0x87, where top is
// src's top k bits: the product has at most k+7 bits, so it needs no further reduction.
func (g *gen) mulAlpha(dst, src string, k int, s string) {
	if k%8 != 0 || k > 120 {
		panic("mulAlpha: k must be a multiple of 8 up to 120")
	}
	g.op("VPSRLDQ $%d, %s, %s", 16-k/8, src, s) // top k/8 bytes, moved to the bottom
	g.op("VPCLMULQDQ $0x00, %s, %s, %s", zPoly, s, s)
	g.op("VPSLLDQ $%d, %s, %s", k/8, src, dst)
	g.op("VPXORQ %s, %s, %s", s, dst, dst)
}

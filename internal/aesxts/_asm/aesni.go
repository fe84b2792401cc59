package main

// aesni emits encAESNI or decAESNI: XTS on XMM registers with AES-NI and SSE2.
//
// Registers: X0..X7 eight blocks, X8 the tweak of the first block not yet given one,
// X9 scratch, X10 the carry mask, X11 the current round key, X12 the last round key, X13
// the first, X14 the next unit's first tweak, X15 the tweak key's current round key.
//
// The 256-byte frame holds two sets of eight tweaks. 0..127: the current batch's, each
// XOR the last round key: AESENCLAST(x, k^T) = AESENCLAST(x, k)^T (the last round ends
// with the key XOR, and so does AESDECLAST), so the tweak's second XOR costs nothing.
// 128..255: the next batch's, made one per round between the current batch's AES
// instructions, so that a batch starts with its tweaks ready instead of with a chain of
// eight dependent multiplications (BenchmarkEngines; docs/benchmarks.md, "Measurements
// behind design choices").
func (g *gen) aesni(d direction) {
	name := d.name + "AESNI"
	g.line("// func %s(k, tk *[240]byte, rounds int, dst, src *byte, unit, count int, first uint64)", name)
	g.line("TEXT ·%s(SB), NOSPLIT, $256-%d", name, kernelArgs)
	g.loadArgs()
	g.op("MOVOU carrymask<>(SB), X10")
	g.op("CMPQ R9, $10")
	g.op("JEQ r10")
	g.aesniBody(d, 14)
	g.label("r10")
	g.aesniBody(d, 10)
	g.line("")
}

func (g *gen) aesniBody(d direction, rounds int) {
	p := reg("r", rounds)
	g.tweakSSE(rounds)
	g.op("MOVOU 0(AX), X13")
	g.op("MOVOU %d(AX), X12", 16*rounds)

	g.label(p + "unit")
	g.op("MOVO X14, X8")
	// The next unit's tweak, if there is one, while this one's blocks run.
	g.op("CMPQ R12, $1")
	g.op("JEQ %slast", p)
	g.op("INCQ R10")
	g.tweakSSE(rounds)
	g.label(p + "last")
	// The tweaks of the unit's first eight blocks.
	for i := 0; i < 8; i++ {
		g.op("MOVOU X8, %d(SP)", 128+16*i)
		g.mulAlphaSSE("X8", "X9")
	}
	g.op("MOVQ R8, DX")
	g.op("CMPQ DX, $128")
	g.op("JB %stail", p)

	g.label(p + "loop8")
	for i := 0; i < 8; i++ {
		x := reg("X", i)
		g.op("MOVOU %d(SP), X9", 128+16*i)
		g.op("MOVOU %d(SI), %s", 16*i, x)
		g.op("PXOR X9, %s", x)
		g.op("PXOR X13, %s", x)
		g.op("PXOR X12, X9")
		g.op("MOVOU X9, %d(SP)", 16*i)
	}
	for r := 1; r < rounds; r++ {
		g.op("MOVOU %d(AX), X11", 16*r)
		for i := 0; i < 8; i++ {
			g.op("%s X11, X%d", d.round, i)
		}
		if r <= 8 { // the next batch's tweak r-1 (wasted after the last batch)
			g.op("MOVOU X8, %d(SP)", 128+16*(r-1))
			g.mulAlphaSSE("X8", "X9")
		}
	}
	for i := 0; i < 8; i++ {
		g.op("MOVOU %d(SP), X9", 16*i)
		g.op("%s X9, X%d", d.lastRound, i)
		g.op("MOVOU X%d, %d(DI)", i, 16*i)
	}
	g.op("ADDQ $128, SI")
	g.op("ADDQ $128, DI")
	g.op("SUBQ $128, DX")
	g.op("CMPQ DX, $128")
	g.op("JAE %sloop8", p)

	// Fewer than eight blocks left, their tweaks waiting in the frame: one block at a
	// time. Units of whole 128 bytes (every sector size) never get here.
	g.label(p + "tail")
	g.op("TESTQ DX, DX")
	g.op("JZ %snext", p)
	g.op("LEAQ 128(SP), R11")
	g.label(p + "loop1")
	g.op("MOVOU 0(SI), X0")
	g.op("MOVOU 0(R11), X1")
	g.op("PXOR X1, X0")
	g.op("PXOR X13, X0")
	g.op("PXOR X12, X1")
	for r := 1; r < rounds; r++ {
		g.op("MOVOU %d(AX), X11", 16*r)
		g.op("%s X11, X0", d.round)
	}
	g.op("%s X1, X0", d.lastRound)
	g.op("MOVOU X0, 0(DI)")
	g.op("ADDQ $16, SI")
	g.op("ADDQ $16, DI")
	g.op("ADDQ $16, R11")
	g.op("SUBQ $16, DX")
	g.op("JNZ %sloop1", p)

	g.label(p + "next")
	g.op("DECQ R12")
	g.op("JNZ %sunit", p)

	// Tweaks and round keys are secret: clear the frame and the registers that held them.
	g.op("PXOR X9, X9")
	for i := 0; i < 16; i++ {
		g.op("MOVOU X9, %d(SP)", 16*i)
	}
	// All sixteen, data included, as every kernel of eli leaves its registers: one rule
	// that a test can check (wipe_amd64_test.go).
	for i := 0; i < 16; i++ {
		if i != 9 {
			g.op("PXOR X%d, X%d", i, i)
		}
	}
	g.op("RET")
}

// tweakSSE sets X14 to a unit's first tweak: the block LE128(R10) encrypted with the
// tweak key's schedule at BX.
func (g *gen) tweakSSE(rounds int) {
	g.op("MOVQ R10, X14") // zero-extends: the upper 64 bits of the block are zero
	g.op("MOVOU 0(BX), X15")
	g.op("PXOR X15, X14")
	for r := 1; r < rounds; r++ {
		g.op("MOVOU %d(BX), X15", 16*r)
		g.op("AESENC X15, X14")
	}
	g.op("MOVOU %d(BX), X15", 16*rounds)
	g.op("AESENCLAST X15, X14")
}

// mulAlphaSSE multiplies the tweak in t by α (see the carrymask constant), with
// scratch register s; X10 holds carrymask.
func (g *gen) mulAlphaSSE(t, s string) {
	g.op("MOVO %s, %s", t, s)
	g.op("PSRAL $31, %s", s)           // each dword's top bit, spread over the dword
	g.op("PSHUFD $0x13, %s, %s", s, s) // dword 0 <- dword 3, dword 2 <- dword 1
	g.op("PAND X10, %s", s)
	g.op("PADDQ %s, %s", t, t) // both 64-bit halves shifted left by one
	g.op("PXOR %s, %s", s, t)
}

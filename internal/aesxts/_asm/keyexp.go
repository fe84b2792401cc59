package main

// Round constants of FIPS-197 §5.2 (Rcon[i] = x^(i-1) in GF(2^8)), as AESKEYGENASSIST
// immediates.
var rcon = []int{0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x1b, 0x36}

// expandKey emits expandKeyAESNI(key *byte, rounds int, enc, dec *[240]byte): the
// rounds+1 encryption round keys of the AES key at key (16 bytes for 10 rounds, 32 for
// 14) into enc and, unless dec is nil, the decryption round keys of the equivalent
// inverse cipher into dec. It runs once per volume; only its constant-time property
// matters, which AESKEYGENASSIST and AESIMC give.
func (g *gen) expandKey() {
	g.line("// func expandKeyAESNI(key *byte, rounds int, enc, dec *[240]byte)")
	g.line("TEXT ·expandKeyAESNI(SB), NOSPLIT, $0-32")
	g.op("MOVQ key+0(FP), AX")
	g.op("MOVQ rounds+8(FP), R9")
	g.op("MOVQ enc+16(FP), DI")
	g.op("MOVQ dec+24(FP), SI")
	g.op("CMPQ R9, $10")
	g.op("JEQ aes128")

	// AES-256: w[0..7] is the key; each step of 8 words derives the first four from
	// RotWord(SubWord(w[i-1])) ^ Rcon and the last four from SubWord(w[i-1]).
	g.op("MOVOU 0(AX), X1")
	g.op("MOVOU 16(AX), X3")
	g.op("MOVOU X1, 0(DI)")
	g.op("MOVOU X3, 16(DI)")
	for i := 0; i < 7; i++ {
		g.op("AESKEYGENASSIST $0x%02x, X3, X2", rcon[i])
		g.op("PSHUFD $0xff, X2, X2") // dword 3: RotWord(SubWord(X3's word 3)) ^ Rcon
		g.prefixXor("X1", "X2")
		g.op("MOVOU X1, %d(DI)", 16*(2*i+2))
		if i == 6 {
			break
		}
		g.op("AESKEYGENASSIST $0x00, X1, X2")
		g.op("PSHUFD $0xaa, X2, X2") // dword 2: SubWord(X1's word 3), no rotation
		g.prefixXor("X3", "X2")
		g.op("MOVOU X3, %d(DI)", 16*(2*i+3))
	}
	g.invert(14)
	g.op("JMP done")

	g.label("aes128")
	g.op("MOVOU 0(AX), X1")
	g.op("MOVOU X1, 0(DI)")
	for i := 0; i < 10; i++ {
		g.op("AESKEYGENASSIST $0x%02x, X1, X2", rcon[i])
		g.op("PSHUFD $0xff, X2, X2")
		g.prefixXor("X1", "X2")
		g.op("MOVOU X1, %d(DI)", 16*(i+1))
	}
	g.invert(10)

	g.label("done")
	// The key passed through these registers; leave none of it behind.
	for i := 0; i < 16; i++ {
		g.op("PXOR X%d, X%d", i, i)
	}
	g.op("RET")
	g.line("")
}

// prefixXor sets the four words w0..w3 of x to w0, w0^w1, w0^w1^w2, w0^w1^w2^w3 (the
// chained XOR of the key schedule), then XORs in t, whose four words are equal.
func (g *gen) prefixXor(x, t string) {
	g.op("MOVO %s, X4", x)
	for i := 0; i < 3; i++ {
		g.op("PSLLO $4, X4")
		g.op("PXOR X4, %s", x)
	}
	g.op("PXOR %s, %s", t, x)
}

// invert writes the decryption schedule into SI unless SI is nil: the encryption round
// keys in reverse order, the inner ones through InvMixColumns (AESIMC).
func (g *gen) invert(rounds int) {
	skip := "noinv" + itoa(rounds)
	g.op("TESTQ SI, SI")
	g.op("JZ %s", skip)
	g.op("MOVOU %d(DI), X1", 16*rounds)
	g.op("MOVOU X1, 0(SI)")
	for i := 1; i < rounds; i++ {
		// Through a register: a legacy-SSE memory operand must be 16-byte aligned,
		// and the schedule need not be.
		g.op("MOVOU %d(DI), X1", 16*(rounds-i))
		g.op("AESIMC X1, X1")
		g.op("MOVOU X1, %d(SI)", 16*i)
	}
	g.op("MOVOU 0(DI), X1")
	g.op("MOVOU X1, %d(SI)", 16*rounds)
	g.label(skip)
}

func itoa(i int) string { return reg("", i) }

package main

import "fmt"

// polyMany8 and polyMany16 are multi-message kernels: Horner's rule for eight (one
// group) or sixteen (two groups) independent MAC inputs of the same shape at once, one
// message per 64-bit lane, each lane with its own r. Where polyIFMA spreads one message
// over the lanes and must first compute r^2…r^16 and at the end join the lanes, these
// need neither: a run of disk sectors is many messages of one length, and for 4 KiB
// sectors the powers and the join were a quarter of polyIFMA's time. Two groups keep
// two independent multiplications in flight, as polyIFMA's two accumulators do.
//
// Each message is ad || pad || ct || pad || lengths, all whole blocks (ct a multiple of
// 16 bytes). The caller lays out the per-lane r (with s1 = 20·r1, s2 = 20·r2) and the
// padded ad blocks as vectors in manyState (ifma_many.go); ct of message k of group g
// is read in place at ct + (8g+k)·stride. Message k sits in lane π(k), π as in
// polyIFMA: the unpacking of two four-message vectors leaves them in that order.
//
// Messages 4 KiB apart put a step's sixteen loads in one set of the 8-way L1 cache, so
// the second group runs skew blocks ahead of the first: its first skew blocks alone,
// then both side by side, then the first group's last skew blocks alone.

// Offsets in manyState.
const (
	mOffR    = 0    // [2][5][8]uint64: per group r0, r1, r2, s1, s2, lane by lane
	mOffAD   = 640  // [2][4][2][8]uint64: per group and ad block, low and high words
	mOffADN  = 1664 // ad blocks
	mOffLens = 1672 // len(ad), len(ct)
	mOffH    = 1688 // [2][3][8]uint64: out, per group the limbs of h
	mGroupR  = 320
	mGroupAD = 512
	mGroupH  = 192
)

// stateVecs is a multiplier of five vectors at off(AX).
func stateVecs(off int) mulr {
	var m mulr
	for i := range m.v {
		m.v[i] = fmt.Sprintf("%d(AX)", off+64*i)
	}
	return m
}

// loadMessages loads block j of the group's eight messages (base in reg, stride R8;
// R9, R10, R11 hold 3, 5 and 7 strides) into msgLo and msgHi, message k in lane π(k).
func (g *gen) loadMessages(base string) {
	at := func(i string) string { return fmt.Sprintf("(%s)(%s)", base, i) }
	g.op("VMOVDQU64 (%s), X%s", base, msgLo[1:])
	g.op("VINSERTI64X2 $1, %s, %s, %s", at("R8*1"), msgLo, msgLo)
	g.op("VINSERTI64X2 $2, %s, %s, %s", at("R8*2"), msgLo, msgLo)
	g.op("VINSERTI64X2 $3, %s, %s, %s", at("R9*1"), msgLo, msgLo)
	g.op("VMOVDQU64 %s, X%s", at("R8*4"), msgT[1:])
	g.op("VINSERTI64X2 $1, %s, %s, %s", at("R10*1"), msgT, msgT)
	g.op("VINSERTI64X2 $2, %s, %s, %s", at("R9*2"), msgT, msgT)
	g.op("VINSERTI64X2 $3, %s, %s, %s", at("R11*1"), msgT, msgT)
	g.op("VPUNPCKHQDQ %s, %s, %s", msgT, msgLo, msgHi) // high 64 bits: messages 0 4 1 5 …
	g.op("VPUNPCKLQDQ %s, %s, %s", msgT, msgLo, msgLo) // low 64 bits
}

func (g *gen) manyKernel(groups int) {
	name := fmt.Sprintf("polyMany%d", 8*groups)
	hs := []num{{"Z0", "Z1", "Z2"}, {"Z3", "Z4", "Z5"}}[:groups]
	bases := []string{"SI", "DI"}[:groups]
	mulAll := func() {
		if groups == 2 {
			g.mul2(hs[0], stateVecs(mOffR), hs[1], stateVecs(mOffR+mGroupR))
		} else {
			g.mul(hs[0], stateVecs(mOffR), chainA)
		}
	}
	g.line("// func %s(st *manyState, ct *byte, stride, blocks, skew int)", name)
	g.line("//")
	g.line("// Horner's rule over %d messages: st's ad blocks, then blocks 16-byte blocks", 8*groups)
	g.line("// of each message's ciphertext (message i at ct + i·stride), then st's lengths;")
	g.line("// st.h receives h, limb by limb and lane by lane, partly reduced.")
	if groups == 2 {
		g.line("// The second group runs skew ≤ blocks blocks ahead of the first (see skewMany).")
	}
	g.line("TEXT ·%s(SB), NOSPLIT, $0-40", name)
	g.op("MOVQ st+0(FP), AX")
	g.op("MOVQ ct+8(FP), SI")
	g.op("MOVQ stride+16(FP), R8")
	g.op("MOVQ blocks+24(FP), DX")
	g.op("MOVQ skew+32(FP), R13")
	g.op("LEAQ (R8)(R8*2), R9")
	g.op("LEAQ (R8)(R8*4), R10")
	g.op("LEAQ (R9)(R8*4), R11")
	if groups == 2 {
		g.op("LEAQ (SI)(R8*8), DI")
	}
	g.constants()
	for _, h := range hs {
		for _, r := range h {
			g.op("VPXORQ %s, %s, %s", r, r, r)
		}
	}
	ad, adLoop, ct, ctLoop, lens := g.label("ad"), g.label("adloop"), g.label("ct"), g.label("ctloop"), g.label("lens")
	g.line("%s:", ad)
	g.op("MOVQ %d(AX), BX", mOffADN)
	g.op("LEAQ %d(AX), R12", mOffAD)
	g.op("TESTQ BX, BX")
	g.op("JZ %s", ct)
	g.line("%s:", adLoop)
	for gi, h := range hs {
		g.op("VMOVDQU64 %d(R12), %s", gi*mGroupAD, msgLo)
		g.op("VMOVDQU64 %d(R12), %s", gi*mGroupAD+64, msgHi)
		g.addSplit(h)
	}
	mulAll()
	g.op("ADDQ $128, R12")
	g.op("DECQ BX")
	g.op("JNZ %s", adLoop)
	g.line("%s:", ct)
	alone := func(gi int, label string) {
		// Group gi's next R13 blocks, without the other.
		done := g.label("alone")
		g.op("MOVQ R13, BX")
		g.op("TESTQ BX, BX")
		g.op("JZ %s", done)
		g.line("%s:", label)
		g.loadMessages(bases[gi])
		g.addSplit(hs[gi])
		g.mul(hs[gi], stateVecs(mOffR+gi*mGroupR), []chain{chainA, chainB}[gi])
		g.op("ADDQ $16, %s", bases[gi])
		g.op("DECQ BX")
		g.op("JNZ %s", label)
		g.line("%s:", done)
	}
	if groups == 2 {
		alone(1, g.label("ahead"))
		g.op("SUBQ R13, DX")
	}
	g.op("TESTQ DX, DX")
	g.op("JZ %s", lens)
	g.line("%s:", ctLoop)
	for gi, h := range hs {
		g.loadMessages(bases[gi])
		g.addSplit(h)
	}
	mulAll()
	for _, b := range bases {
		g.op("ADDQ $16, %s", b)
	}
	g.op("DECQ DX")
	g.op("JNZ %s", ctLoop)
	g.line("%s:", lens)
	if groups == 2 {
		alone(0, g.label("behind"))
	}
	for _, h := range hs {
		g.op("VPBROADCASTQ %d(AX), %s", mOffLens, msgLo)
		g.op("VPBROADCASTQ %d(AX), %s", mOffLens+8, msgHi)
		g.addSplit(h)
	}
	mulAll()
	for gi, h := range hs {
		for i, r := range h {
			g.op("VMOVDQU64 %s, %d(AX)", r, mOffH+gi*mGroupH+64*i)
		}
	}
	// Nothing on the stack; the registers held one-time key material.
	g.wipeRet()
	g.line("")
}

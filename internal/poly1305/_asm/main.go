// Command asmgen writes ../poly1305_amd64.s, the AVX-512 IFMA Poly1305 kernels (the
// multi-message ones are in many.go):
//
//	cd poly1305/_asm && go run . -out ../poly1305_amd64.s
//
// A plain Go program that prints Go assembly, like chacha/_asm: the multiplication and
// the carry chain are loops over register names, which read better here than macros.
//
// polyIFMA runs Horner's rule (RFC 8439 §2.5.1: h = (h + block)·r mod 2^130−5) over a
// sequence of 128-byte chunks of 16-byte blocks, one block per 64-bit lane of a ZMM
// register, every block with its 2^128 bit (ifma.go lays out the AEAD input so). Numbers
// are held in radix 2^44: three limbs of 44, 44 and 42 bits, so that a limb product fits
// the 52×52-bit multipliers of AVX-512 IFMA (VPMADD52LUQ/VPMADD52HUQ add the low/high
// 52 bits of a product to an accumulator). The radix-2^44 IFMA idea is public: S. Gueron
// and V. Krasnov's work and OpenSSL's poly1305-x86_64 avx512ifma path describe it; this
// code is our own.
//
// Lane L of a chunk holds block π(L) of that chunk's eight, where π = (0 4 1 5 2 6 3 7)
// is the order VPUNPCKLQDQ/VPUNPCKHQDQ leave the blocks in. Two accumulators take
// alternate chunks and multiply by r^16 per pair; at the end the lanes are multiplied
// by p, lane L holding r^(8−π(L)) (times r^t for all but the tail chunk, see the
// kernel), and summed: Σ block_i·r^(n−i) over the n blocks, as Horner's rule gives.
//
// Bounds (limbs as 44/44/42-bit numbers): after a multiplication and its carry chain
// h0 < 2^44, h1 < 2^44+2^12, h2 < 2^42; a lane's input to a multiplication is at most
// two such values plus a block (< 2^44, 2^44, 2^41) or a correction lane (below 2^44,
// 2^44, 2^42), so every limb is below 2^46; multiplier limbs (r^k reduced the same way,
// or s = 20·r) are below 2^48.4; products stay below 2^95, so every IFMA input is under
// 2^52 and every accumulator under 2^56. The final lane sums are below 2^48.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"log"
	"os"
)

type gen struct {
	b      bytes.Buffer
	labels int
}

func (g *gen) line(format string, a ...any) { fmt.Fprintf(&g.b, format+"\n", a...) }
func (g *gen) op(format string, a ...any)   { g.line("\t"+format, a...) }

func (g *gen) label(prefix string) string {
	g.labels++
	return fmt.Sprintf("%s%d", prefix, g.labels)
}

// num is a radix-2^44 number in three registers, limb 0 first.
type num [3]string

// mulr is a multiplier: its three limbs and s1 = 20·r1, s2 = 20·r2. 2^130 ≡ 5 (mod
// 2^130−5), so a product term at 2^132 (limb 1 × limb 2) folds back to limb 0 times 20,
// and one at 2^176 (limb 2 × limb 2) to limb 1 times 20. With bcst set the five are
// memory operands holding one 64-bit value each, broadcast to every lane.
type mulr struct {
	v    [5]string // r0, r1, r2, s1, s2
	bcst bool
}

func regs(r num, s1, s2 string) mulr { return mulr{v: [5]string{r[0], r[1], r[2], s1, s2}} }

// Fixed registers.
const (
	mask44 = "Z23" // 2^44−1 in every lane
	mask42 = "Z24" // 2^42−1
	hibit  = "Z25" // 2^40: the 2^128 bit of a block, in limb 2
	msgLo  = "Z28"
	msgHi  = "Z29"
	msgT   = "Z30"
)

// Offsets in the kernel's state (ifmaState in ifma.go).
const (
	offR  = 0  // [3]uint64: r in radix 2^44
	offKZ = 24 // lanes of the first chunk that hold leading zero blocks
	offKT = 32 // lanes of the tail chunk that hold no block
	offPK = 40 // the lane of p that holds r^t, t being the tail's block count
	offH  = 48 // [3]uint64: the limb sums, on return
)

// The kernel's frame (hardware SP offsets): p and pk as five vectors each (limbs and
// s1, s2), r^8 and r^16 as five words each.
const (
	frameP   = 0
	framePK  = 320
	frameR8  = 640
	frameR16 = 680
	frameLen = 720
)

// chain is one multiplication's working registers: its six accumulators (low and high
// 52-bit halves of the three output limbs) and a temporary.
type chain struct {
	acc [3][2]string
	tmp string
}

var (
	chainA = chain{[3][2]string{{"Z11", "Z12"}, {"Z13", "Z14"}, {"Z15", "Z16"}}, "Z26"}
	chainB = chain{[3][2]string{{"Z17", "Z18"}, {"Z19", "Z20"}, {"Z21", "Z22"}}, "Z27"}
)

// sFrom sets s1, s2 to 20·r1, 20·r2 ((x + 4x)·4).
func (g *gen) sFrom(r num, s1, s2 string) {
	for _, p := range [][2]string{{r[1], s1}, {r[2], s2}} {
		g.op("VPSLLQ $2, %s, %s", p[0], p[1])
		g.op("VPADDQ %s, %s, %s", p[0], p[1], p[1])
		g.op("VPSLLQ $2, %s, %s", p[1], p[1])
	}
}

// mulOps returns the instructions setting h = h·m mod 2^130−5, lane by lane, partly
// reduced (see the bounds above), with c's registers.
func mulOps(h num, m mulr, c chain) []string {
	var ops []string
	op := func(format string, a ...any) { ops = append(ops, fmt.Sprintf(format, a...)) }
	for _, a := range c.acc {
		op("VPXORQ %s, %s, %s", a[0], a[0], a[0])
		op("VPXORQ %s, %s, %s", a[1], a[1], a[1])
	}
	r0, r1, r2, s1, s2 := m.v[0], m.v[1], m.v[2], m.v[3], m.v[4]
	// terms[k][j]: what limb k of h multiplies to land in output limb j.
	terms := [3][3]string{
		{r0, r1, r2},
		{s2, r0, r1},
		{s1, s2, r0},
	}
	suffix := ""
	if m.bcst {
		suffix = ".BCST"
	}
	// Limb 2 comes out of the previous carry chain first, then limb 0, then limb 1.
	for _, k := range []int{2, 0, 1} {
		for j := 0; j < 3; j++ {
			op("VPMADD52LUQ%s %s, %s, %s", suffix, terms[k][j], h[k], c.acc[j][0])
			op("VPMADD52HUQ%s %s, %s, %s", suffix, terms[k][j], h[k], c.acc[j][1])
		}
	}
	// Output limb j's low half sits at 2^(44j), its high half at 2^(44j+52): 8 bits
	// into limb j+1, or for j = 2 at 2^140 = 2^130·2^10 ≡ 5·2^10.
	t := c.tmp
	for j := 0; j < 2; j++ {
		lo, hi := c.acc[j][0], c.acc[j][1]
		op("VPSRLQ $44, %s, %s", lo, t)
		op("VPSLLQ $8, %s, %s", hi, hi)
		op("VPANDQ %s, %s, %s", mask44, lo, h[j])
		op("VPADDQ %s, %s, %s", t, hi, hi)
		op("VPADDQ %s, %s, %s", hi, c.acc[j+1][0], c.acc[j+1][0])
	}
	lo, hi := c.acc[2][0], c.acc[2][1]
	op("VPSRLQ $42, %s, %s", lo, t)
	op("VPSLLQ $10, %s, %s", hi, hi)
	op("VPANDQ %s, %s, %s", mask42, lo, h[2])
	op("VPADDQ %s, %s, %s", t, hi, hi) // the excess over 2^130, times 5 into h0
	op("VPADDQ %s, %s, %s", hi, h[0], h[0])
	op("VPSLLQ $2, %s, %s", hi, hi)
	op("VPADDQ %s, %s, %s", hi, h[0], h[0])
	op("VPSRLQ $44, %s, %s", h[0], t)
	op("VPANDQ %s, %s, %s", mask44, h[0], h[0])
	op("VPADDQ %s, %s, %s", t, h[1], h[1])
	return ops
}

func (g *gen) mul(h num, m mulr, c chain) {
	for _, o := range mulOps(h, m, c) {
		g.op("%s", o)
	}
}

// mul2 emits two independent multiplications interleaved, so that each one's
// dependency chain fills the other's gaps.
func (g *gen) mul2(h1 num, m1 mulr, h2 num, m2 mulr) {
	a, b := mulOps(h1, m1, chainA), mulOps(h2, m2, chainB)
	for i := range a {
		g.op("%s", a[i])
	}
	for i := range b {
		g.op("%s", b[i])
	}
}

// addChunk adds the next eight blocks to h, each with its 2^128 bit. The chunks come
// from a list of segments (SI: the next chunk, CX: bytes left in its segment, DI: the
// next segment); a segment is a pointer and a length, a multiple of 128.
func (g *gen) addChunk(h num) {
	have := g.label("have")
	g.op("TESTQ CX, CX")
	g.op("JNZ %s", have)
	g.op("MOVQ (DI), SI")
	g.op("MOVQ 8(DI), CX")
	g.op("ADDQ $16, DI")
	g.line("%s:", have)
	g.op("VMOVDQU64 (SI), %s", msgT)
	g.op("VPUNPCKHQDQ 64(SI), %s, %s", msgT, msgHi) // high 64 bits of blocks π(0..7)
	g.op("VPUNPCKLQDQ 64(SI), %s, %s", msgT, msgLo) // low 64 bits
	g.op("ADDQ $128, SI")
	g.op("SUBQ $128, CX")
	g.addSplit(h)
}

// addSplit adds the blocks whose low and high 64 bits are in msgLo and msgHi (one block
// per lane) to h, in radix 2^44 and with their 2^128 bit. It clobbers the message
// registers.
func (g *gen) addSplit(h num) {
	g.op("VPANDQ %s, %s, %s", mask44, msgLo, msgT)
	g.op("VPADDQ %s, %s, %s", msgT, h[0], h[0])
	g.op("VPSRLQ $44, %s, %s", msgLo, msgLo)
	g.op("VPSLLQ $20, %s, %s", msgHi, msgT)
	g.op("VPTERNLOGQ $0xa8, %s, %s, %s", mask44, msgT, msgLo) // (lo | t) & mask44
	g.op("VPADDQ %s, %s, %s", msgLo, h[1], h[1])
	g.op("VPSRLQ $24, %s, %s", msgHi, msgHi)
	g.op("VPORQ %s, %s, %s", hibit, msgHi, msgHi)
	g.op("VPADDQ %s, %s, %s", msgHi, h[2], h[2])
}

func (g *gen) addNum(dst, src num) {
	for i := range dst {
		g.op("VPADDQ %s, %s, %s", src[i], dst[i], dst[i])
	}
}

// blend sets dst = lanes of a where mask k is set, b elsewhere.
func (g *gen) blend(dst, a, b, k string) {
	g.op("VPBLENDMQ %s, %s, %s, %s", a, b, k, dst)
}

// store writes lane 0 of the registers to consecutive words at off(AX).
func (g *gen) store(off int, rs ...string) {
	for i, r := range rs {
		g.op("VMOVQ X%s, %d(AX)", r[1:], off+8*i)
	}
}

// bcastMem is a multiplier of five words at off(SP) (plus index, a register
// scaled by 8, if not empty), each broadcast to every lane.
func bcastMem(off int, index string) mulr {
	m := mulr{bcst: true}
	for i := range m.v {
		m.v[i] = fmt.Sprintf("%d(SP)", off+8*i)
		if index != "" {
			m.v[i] = fmt.Sprintf("%d(SP)(%s*8)", off+64*i, index)
		}
	}
	return m
}

// vecMem is a multiplier of five vectors at off(SP).
func vecMem(off int) mulr {
	var m mulr
	for i := range m.v {
		m.v[i] = fmt.Sprintf("%d(SP)", off+64*i)
	}
	return m
}

// storeVecs writes whole registers to consecutive 64-byte slots at off(SP).
func (g *gen) storeVecs(off int, rs ...string) {
	for i, r := range rs {
		g.op("VMOVDQU64 %s, %d(SP)", r, off+64*i)
	}
}

// storeLane0 writes lane 0 of the registers to consecutive words at off(SP).
func (g *gen) storeLane0(off int, rs ...string) {
	for i, r := range rs {
		g.op("VMOVQ X%s, %d(SP)", r[1:], off+8*i)
	}
}

// corrections sets h to −2^128 ≡ 3·2^128−5 (mod 2^130−5) in the lanes of mask k and to
// zero elsewhere: what a lane holding no block needs so that the 2^128 bit the kernel
// adds to it comes to 0.
func (g *gen) corrections(h num, k string) {
	for i, v := range []uint64{1<<44 - 5, 1<<44 - 1, 3<<40 - 1} {
		g.op("MOVQ $0x%x, BX", v)
		g.op("VPBROADCASTQ.Z BX, %s, %s", k, h[i])
	}
}

func (g *gen) kernel() {
	g.line("// func polyIFMA(st *ifmaState, segs *[maxSegments]segment, regular int, tail *byte)")
	g.line("//")
	g.line("// regular is the number of 128-byte chunks in the segments; tail is the tail")
	g.line("// chunk. st.h receives the sums of the final lanes, limb by limb (each below")
	g.line("// 2^48, not carried). The frame holds no pointers.")
	g.line("TEXT ·polyIFMA(SB), 0, $%d-32", frameLen)
	g.op("NO_LOCAL_POINTERS")
	g.op("MOVQ st+0(FP), AX")
	g.op("MOVQ segs+8(FP), DI")
	g.op("MOVQ regular+16(FP), DX")
	g.op("MOVQ tail+24(FP), R8")
	g.op("XORQ CX, CX")

	g.constants()
	const one, zero = "Z28", "Z29" // the number 1 (limb 0), and 0: setup only
	g.op("MOVQ $1, BX")
	g.op("VPBROADCASTQ BX, %s", one)
	g.op("VPXORQ %s, %s, %s", zero, zero, zero)
	for i, m := range []int{0x03, 0x0f, 0xc0, 0xaa} {
		g.op("MOVL $0x%02x, BX", m)
		g.op("KMOVW BX, K%d", i+1)
	}
	g.op("MOVQ %d(AX), BX", offKZ)
	g.op("KMOVW BX, K5")
	g.op("MOVQ %d(AX), BX", offKT)
	g.op("KMOVW BX, K6")
	g.op("MOVQ %d(AX), R10", offPK)

	// The powers of r, lanes paired by the block order π, in three multiplications:
	//   r2  = r·r                                   (every lane)
	//   q   = a·b, a = (r2 r2 r r r r r r), b = (r2 r2 r2 r2 r r 1 1)
	//       = (r4 r4 r3 r3 r2 r2 r r)
	//   p   = q·c, c = (r4 1 r4 1 r4 1 r4 1)
	//       = (r8 r4 r7 r3 r6 r2 r5 r), lane L holding r^(8−π(L))
	// then, side by side, r^16 = r^8·r^8 and pk = p·r^t.
	r1 := num{"Z17", "Z18", "Z19"}
	for i, reg := range r1 {
		g.op("VPBROADCASTQ %d(AX), %s", offR+8*i, reg)
	}
	g.sFrom(r1, "Z20", "Z21")
	r2 := num{"Z0", "Z1", "Z2"}
	for i := range r2 {
		g.op("VMOVDQA64 %s, %s", r1[i], r2[i])
	}
	g.mul(r2, regs(r1, "Z20", "Z21"), chainA)
	p := num{"Z6", "Z7", "Z8"}
	const ps1, ps2 = "Z9", "Z10"
	b := num{"Z3", "Z4", "Z5"}
	for i := range p {
		g.blend(p[i], r2[i], r1[i], "K1") // a, built in p
		g.blend(b[i], r2[i], r1[i], "K2")
		oneLimb := zero
		if i == 0 {
			oneLimb = one
		}
		g.blend(b[i], oneLimb, b[i], "K3")
	}
	g.sFrom(b, ps1, ps2)
	g.mul(p, regs(b, ps1, ps2), chainA) // q
	for i := range p {
		g.op("VPBROADCASTQ X%s, %s", p[i][1:], b[i])
		oneLimb := zero
		if i == 0 {
			oneLimb = one
		}
		g.blend(b[i], oneLimb, b[i], "K4")
	}
	g.sFrom(b, ps1, ps2)
	g.mul(p, regs(b, ps1, ps2), chainA) // p
	g.sFrom(p, ps1, ps2)
	g.storeVecs(frameP, p[0], p[1], p[2], ps1, ps2)
	g.storeLane0(frameR8, p[0], p[1], p[2], ps1, ps2)
	r16 := num{"Z0", "Z1", "Z2"}
	pk := num{"Z3", "Z4", "Z5"}
	for i := range pk {
		g.op("VMOVDQA64 %s, %s", p[i], pk[i])
	}
	g.op("TESTQ DX, DX")
	g.op("JZ tail") // no regular chunks: no pk either
	g.op("CMPQ DX, $3")
	g.op("JLT pkonly") // no pair loop and no odd ending: no r^16
	for i := range r16 {
		g.op("VPBROADCASTQ X%s, %s", p[i][1:], r16[i])
	}
	g.mul2(r16, bcastMem(frameR8, ""), pk, bcastMem(frameP, "R10"))
	g.sFrom(r16, "Z28", "Z29")
	g.storeLane0(frameR16, r16[0], r16[1], r16[2], "Z28", "Z29")
	g.op("JMP pkdone")
	g.line("pkonly:")
	g.mul(pk, bcastMem(frameP, "R10"), chainA)
	g.line("pkdone:")
	g.sFrom(pk, "Z28", "Z29")
	g.storeVecs(framePK, pk[0], pk[1], pk[2], "Z28", "Z29")

	// Chain A starts with the corrections for the first chunk's leading zero blocks,
	// chain B with zero.
	hA := num{"Z0", "Z1", "Z2"}
	hB := num{"Z3", "Z4", "Z5"}
	tl := num{"Z6", "Z7", "Z8"}
	g.corrections(hA, "K5")
	for i := range hB {
		g.op("VPXORQ %s, %s, %s", hB[i], hB[i], hB[i])
	}
	// The tail chunk: its blocks right-aligned, corrections in the lanes before them.
	g.corrections(tl, "K6")
	g.op("MOVQ R8, SI")
	g.op("MOVQ $128, CX")
	g.addChunk(tl)
	g.op("XORQ CX, CX")
	pm := vecMem(frameP)
	pkm := vecMem(framePK)

	// Chains A and B take alternate regular chunks, each multiplied by r^16 per pair;
	// the last two or three chunks bring them together under pk = p·r^t:
	//   one:  h = (hA + x)·pk
	//   even: hA = (hA + x)·r^8; h = hA + hB + y; h·pk
	//   odd:  hA = (hA + x)·r^16; hB = (hB + y)·r^8; h = hA + hB + z; h·pk
	// so that block j of regular chunk i gets r^(8·(regular−i)−j+t) in all, and the
	// tail, t blocks under p, r^t ... r^1 (Horner's rule).
	g.op("CMPQ DX, $1")
	g.op("JNE pairs")
	g.addChunk(hA)
	g.op("JMP final")
	g.line("pairs:")
	g.op("LEAQ -2(DX), BX")
	g.op("SHRQ $1, BX") // pairs before the ending
	g.op("JZ ending")
	g.line("loop:")
	g.addChunk(hA)
	g.addChunk(hB)
	g.mul2(hA, bcastMem(frameR16, ""), hB, bcastMem(frameR16, ""))
	g.op("DECQ BX")
	g.op("JNZ loop")
	g.line("ending:")
	g.op("TESTQ $1, DX")
	g.op("JNZ odd")
	g.addChunk(hA)
	g.mul(hA, bcastMem(frameR8, ""), chainA)
	g.addChunk(hB)
	g.addNum(hA, hB)
	g.op("JMP final")
	g.line("odd:")
	g.addChunk(hA)
	g.addChunk(hB)
	g.mul2(hA, bcastMem(frameR16, ""), hB, bcastMem(frameR8, ""))
	g.addChunk(hA)
	g.addNum(hA, hB)
	g.line("final:")
	g.mul2(hA, pkm, tl, pm)
	g.addNum(hA, tl)
	g.op("JMP sum")

	g.line("tail:")
	g.corrections(tl, "K6")
	g.op("MOVQ R8, SI")
	g.op("MOVQ $128, CX")
	g.addChunk(tl)
	g.mul(tl, vecMem(frameP), chainA)
	for i := range hA {
		g.op("VMOVDQA64 %s, %s", tl[i], hA[i])
	}

	// Sum the lanes of each limb.
	g.line("sum:")
	for i := range hA {
		y := "Y" + hA[i][1:]
		g.op("VEXTRACTI64X4 $1, %s, Y13", hA[i])
		g.op("VPADDQ Y13, %s, Y13", y)
		g.op("VEXTRACTI128 $1, Y13, X14")
		g.op("VPADDQ X14, X13, X13")
		g.op("VPSHUFD $0x4e, X13, X14")
		g.op("VPADDQ X14, X13, X13")
		g.op("VMOVQ X13, %d(AX)", offH+8*i)
	}
	// The frame held powers of the one-time key: leave none of it on the stack.
	g.op("VPXORQ Z13, Z13, Z13")
	for off := 0; off+64 <= frameLen; off += 64 {
		g.op("VMOVDQU64 Z13, %d(SP)", off)
	}
	if frameLen%64 != 0 {
		g.op("VMOVDQU64 Z13, %d(SP)", frameLen-64)
	}
	// And the registers.
	g.wipeRet()
}

// constants loads the fixed registers mask44, mask42 and hibit.
func (g *gen) constants() {
	g.op("MOVQ $0xfffffffffff, BX")
	g.op("VPBROADCASTQ BX, %s", mask44)
	g.op("MOVQ $0x3ffffffffff, BX")
	g.op("VPBROADCASTQ BX, %s", mask42)
	g.op("MOVQ $0x10000000000, BX")
	g.op("VPBROADCASTQ BX, %s", hibit)
}

// wipeRet zeroes every vector register and returns: ZMM16..31, then the rest whole
// (VZEROUPPER would keep the low 128 bits of ZMM0..15).
func (g *gen) wipeRet() {
	for i := 16; i < 32; i++ {
		g.op("VPXORQ Z%d, Z%d, Z%d", i, i, i)
	}
	g.op("VZEROALL")
	g.op("RET")
}

func main() {
	out := flag.String("out", "../poly1305_amd64.s", "output file")
	flag.Parse()
	var g gen
	g.line("// Code generated by poly1305/_asm (go run . -out ../poly1305_amd64.s). DO NOT EDIT.")
	g.line("")
	g.line("//go:build amd64 && !purego")
	g.line("")
	g.line(`#include "funcdata.h"`)
	g.line(`#include "textflag.h"`)
	g.line("")
	g.kernel()
	g.line("")
	g.manyKernel(1)
	g.manyKernel(2)
	if err := os.WriteFile(*out, g.b.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}

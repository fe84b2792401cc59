// Command asmgen writes ../poly1305_amd64.s, the AVX-512 IFMA Poly1305 kernel:
//
//	cd poly1305/_asm && go run . -out ../poly1305_amd64.s
//
// A plain Go program that prints Go assembly, like chacha/_asm: the multiplication and
// the carry chain are loops over register names, which read better here than macros.
//
// blocksIFMA runs Horner's rule (RFC 8439 §2.5.1: h = (h + block)·r mod 2^130−5) over
// n bytes of full 16-byte blocks, eight blocks at a time, one block per 64-bit lane of
// a ZMM register. Numbers are held in radix 2^44: three limbs of 44, 44 and 42 bits,
// so that a limb product fits the 52×52-bit multipliers of AVX-512 IFMA
// (VPMADD52LUQ/VPMADD52HUQ add the low/high 52 bits of a product to an accumulator).
// The radix-2^44 IFMA idea is public: S. Gueron and V. Krasnov's work and OpenSSL's
// poly1305-x86_64 avx512ifma path describe it; this code is our own.
//
// Lane L of a chunk holds block π(L) of that chunk's eight, where π = (0 4 1 5 2 6 3 7)
// is the order VPUNPCKLQDQ/VPUNPCKHQDQ leave the blocks in. Every chunk but the last
// multiplies all lanes by r^8; the last multiplies lane L by r^(8−π(L)). The sum of the
// lanes is then h·r^n' + Σ block_i·r^(n'−i) as Horner's rule would give it over the n'
// blocks, with the incoming h added to lane 0 (block 0) of the first chunk.
//
// Bounds (limbs as 44/44/42-bit numbers, "≤" meaning a little above): after a
// multiplication and its carry chain h0 < 2^44, h1 < 2^44+2^12, h2 < 2^42; after adding
// a block (< 2^44, 2^44, 2^41) every limb is below 2^46, and the multiplier limbs (r^k
// reduced the same way, or s = 20·r) are below 2^48.4; products stay below 2^95, so
// every IFMA input is under 2^52 and every accumulator under 2^56. The incoming h from
// Go is partly reduced (its top limb below 2^43), which keeps the same bounds.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"log"
	"os"
)

type gen struct{ b bytes.Buffer }

func (g *gen) line(format string, a ...any) { fmt.Fprintf(&g.b, format+"\n", a...) }
func (g *gen) op(format string, a ...any)   { g.line("\t"+format, a...) }

// num is a radix-2^44 number in three registers, limb 0 first.
type num [3]string

// mulr is a multiplier: its three limbs and s1 = 20·r1, s2 = 20·r2. 2^130 ≡ 5 (mod
// 2^130−5), so a product term at 2^132 (limb 1 × limb 2) folds back to limb 0 times 20,
// and one at 2^176 (limb 2 × limb 2) to limb 1 times 20.
type mulr struct {
	r      num
	s1, s2 string
}

// Fixed registers.
const (
	mask44 = "Z19" // 2^44−1 in every lane
	mask42 = "Z20" // 2^42−1
	hibit  = "Z21" // 2^40: the 2^128 bit of a block, in limb 2
	tmp    = "Z22"
	one    = "Z30" // the number 1 (limb 0)
	zero   = "Z31"
)

// The product accumulators: low and high 52-bit halves for each output limb.
var acc = [3][2]string{{"Z13", "Z14"}, {"Z15", "Z16"}, {"Z17", "Z18"}}

// sFrom sets m.s1, m.s2 to 20·r1, 20·r2 ((x + 4x)·4).
func (g *gen) sFrom(m mulr) {
	for _, p := range [][2]string{{m.r[1], m.s1}, {m.r[2], m.s2}} {
		g.op("VPSLLQ $2, %s, %s", p[0], p[1])
		g.op("VPADDQ %s, %s, %s", p[0], p[1], p[1])
		g.op("VPSLLQ $2, %s, %s", p[1], p[1])
	}
}

// mul sets h = h·m mod 2^130−5, lane by lane, partly reduced (see the bounds above).
func (g *gen) mul(h num, m mulr) {
	for _, a := range acc {
		g.op("VPXORQ %s, %s, %s", a[0], a[0], a[0])
		g.op("VPXORQ %s, %s, %s", a[1], a[1], a[1])
	}
	// terms[k][j]: what limb k of h multiplies to land in output limb j.
	terms := [3][3]string{
		{m.r[0], m.r[1], m.r[2]},
		{m.s2, m.r[0], m.r[1]},
		{m.s1, m.s2, m.r[0]},
	}
	for k := 0; k < 3; k++ {
		for j := 0; j < 3; j++ {
			g.op("VPMADD52LUQ %s, %s, %s", terms[k][j], h[k], acc[j][0])
			g.op("VPMADD52HUQ %s, %s, %s", terms[k][j], h[k], acc[j][1])
		}
	}
	// Output limb j's low half sits at 2^(44j), its high half at 2^(44j+52): 8 bits
	// into limb j+1, or for j = 2 at 2^140 = 2^130·2^10 ≡ 5·2^10.
	for j := 0; j < 2; j++ {
		lo, hi := acc[j][0], acc[j][1]
		g.op("VPSRLQ $44, %s, %s", lo, tmp)
		g.op("VPSLLQ $8, %s, %s", hi, hi)
		g.op("VPANDQ %s, %s, %s", mask44, lo, h[j])
		g.op("VPADDQ %s, %s, %s", tmp, hi, hi)
		g.op("VPADDQ %s, %s, %s", hi, acc[j+1][0], acc[j+1][0])
	}
	lo, hi := acc[2][0], acc[2][1]
	g.op("VPSRLQ $42, %s, %s", lo, tmp)
	g.op("VPSLLQ $10, %s, %s", hi, hi)
	g.op("VPANDQ %s, %s, %s", mask42, lo, h[2])
	g.op("VPADDQ %s, %s, %s", tmp, hi, hi) // the excess over 2^130, times 5 into h0
	g.op("VPADDQ %s, %s, %s", hi, h[0], h[0])
	g.op("VPSLLQ $2, %s, %s", hi, hi)
	g.op("VPADDQ %s, %s, %s", hi, h[0], h[0])
	g.op("VPSRLQ $44, %s, %s", h[0], tmp)
	g.op("VPANDQ %s, %s, %s", mask44, h[0], h[0])
	g.op("VPADDQ %s, %s, %s", tmp, h[1], h[1])
}

// addBlocks adds the eight blocks at 0(SI) to h, with the 2^128 bit set in each.
func (g *gen) addBlocks(h num) {
	const lo, hi = "Z23", "Z24"
	g.op("VMOVDQU64 (SI), %s", tmp)
	g.op("VPUNPCKHQDQ 64(SI), %s, %s", tmp, hi) // high 64 bits of blocks π(0..7)
	g.op("VPUNPCKLQDQ 64(SI), %s, %s", tmp, lo) // low 64 bits
	g.op("VPANDQ %s, %s, %s", mask44, lo, tmp)
	g.op("VPADDQ %s, %s, %s", tmp, h[0], h[0])
	g.op("VPSRLQ $44, %s, %s", lo, lo)
	g.op("VPSLLQ $20, %s, %s", hi, tmp)
	g.op("VPTERNLOGQ $0xa8, %s, %s, %s", mask44, tmp, lo) // (lo | tmp) & mask44
	g.op("VPADDQ %s, %s, %s", lo, h[1], h[1])
	g.op("VPSRLQ $24, %s, %s", hi, hi)
	g.op("VPORQ %s, %s, %s", hibit, hi, hi)
	g.op("VPADDQ %s, %s, %s", hi, h[2], h[2])
}

// blend sets dst = lanes of a where mask k is set, b elsewhere.
func (g *gen) blend(dst, a, b, k string) {
	g.op("VPBLENDMQ %s, %s, %s, %s", a, b, k, dst)
}

func (g *gen) kernel() {
	g.line("// func blocksIFMA(h *[3]uint64, r *[3]uint64, msg *byte, n int)")
	g.line("//")
	g.line("// n is a positive multiple of 128. h holds the incoming accumulator and receives")
	g.line("// the sum of the lanes, limb by limb (each limb below 2^47, not carried).")
	g.line("TEXT ·blocksIFMA(SB), NOSPLIT, $0-32")
	g.op("MOVQ h+0(FP), AX")
	g.op("MOVQ r+8(FP), BX")
	g.op("MOVQ msg+16(FP), SI")
	g.op("MOVQ n+24(FP), CX")

	g.op("MOVQ $0xfffffffffff, DX")
	g.op("VPBROADCASTQ DX, %s", mask44)
	g.op("MOVQ $0x3ffffffffff, DX")
	g.op("VPBROADCASTQ DX, %s", mask42)
	g.op("MOVQ $0x10000000000, DX")
	g.op("VPBROADCASTQ DX, %s", hibit)
	g.op("MOVQ $1, DX")
	g.op("VPBROADCASTQ DX, %s", one)
	g.op("VPXORQ %s, %s, %s", zero, zero, zero)
	for i, m := range []int{0x03, 0x0f, 0xc0, 0xaa} {
		g.op("MOVL $0x%02x, DX", m)
		g.op("KMOVW DX, K%d", i+1)
	}

	// The powers of r. r1 (Z25..Z29) is r in every lane; the powers are built in
	// three multiplications, lanes paired by the block order π:
	//   r2  = r·r                                   (every lane)
	//   q   = a·b, a = (r2 r2 r r r r r r), b = (r2 r2 r2 r2 r r 1 1)
	//       = (r4 r4 r3 r3 r2 r2 r r)
	//   p   = q·c, c = (r4 1 r4 1 r4 1 r4 1)
	//       = (r8 r4 r7 r3 r6 r2 r5 r), lane L holding r^(8−π(L))
	//   r8  = p lane 0 in every lane, the multiplier of every chunk but the last.
	r1 := mulr{num{"Z25", "Z26", "Z27"}, "Z28", "Z29"}
	for i, reg := range r1.r {
		g.op("VPBROADCASTQ %d(BX), %s", 8*i, reg)
	}
	g.sFrom(r1)
	r2 := num{"Z3", "Z4", "Z5"}
	for i := range r2 {
		g.op("VMOVDQA64 %s, %s", r1.r[i], r2[i])
	}
	g.mul(r2, r1)
	p := mulr{num{"Z8", "Z9", "Z10"}, "Z11", "Z12"}
	b := mulr{num{"Z0", "Z1", "Z2"}, "Z6", "Z7"}
	for i := range p.r {
		g.blend(p.r[i], r2[i], r1.r[i], "K1") // a, built in p
		g.blend(b.r[i], r2[i], r1.r[i], "K2")
		oneLimb := zero
		if i == 0 {
			oneLimb = one
		}
		g.blend(b.r[i], oneLimb, b.r[i], "K3")
	}
	g.sFrom(b)
	g.mul(p.r, b) // q
	for i := range p.r {
		g.op("VPBROADCASTQ X%s, %s", p.r[i][1:], b.r[i])
		oneLimb := zero
		if i == 0 {
			oneLimb = one
		}
		g.blend(b.r[i], oneLimb, b.r[i], "K4")
	}
	g.sFrom(b)
	g.mul(p.r, b) // p
	g.sFrom(p)
	r8 := mulr{num{"Z3", "Z4", "Z5"}, "Z6", "Z7"}
	for i := range r8.r {
		g.op("VPBROADCASTQ X%s, %s", p.r[i][1:], r8.r[i])
	}
	g.sFrom(r8)

	// The accumulator enters in lane 0; VMOVQ clears the other lanes.
	h := num{"Z0", "Z1", "Z2"}
	for i := range h {
		g.op("VMOVQ %d(AX), X%s", 8*i, h[i][1:])
	}
	g.op("SUBQ $128, CX")
	g.op("JZ last")
	g.line("loop:")
	g.addBlocks(h)
	g.mul(h, r8)
	g.op("ADDQ $128, SI")
	g.op("SUBQ $128, CX")
	g.op("JNZ loop")
	g.line("last:")
	g.addBlocks(h)
	g.mul(h, p)

	// Sum the lanes of each limb.
	for i := range h {
		y := "Y" + h[i][1:]
		g.op("VEXTRACTI64X4 $1, %s, Y13", h[i])
		g.op("VPADDQ Y13, %s, Y13", y)
		g.op("VEXTRACTI128 $1, Y13, X14")
		g.op("VPADDQ X14, X13, X13")
		g.op("VPSHUFD $0x4e, X13, X14")
		g.op("VPADDQ X14, X13, X13")
		g.op("VMOVQ X13, %d(AX)", 8*i)
	}
	g.op("VZEROUPPER")
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
	g.line(`#include "textflag.h"`)
	g.line("")
	g.kernel()
	if err := os.WriteFile(*out, g.b.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}

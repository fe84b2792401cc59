package main

import "fmt"

// xorAVX512W: the AVX-512 kernel over 32 blocks (2 KiB) a chunk, as two groups of 16
// in all 32 ZMM registers (group A in Z0..15, group B, blocks 16..31, in Z16..31). The
// rounds then interleave eight quarter rounds instead of four: a quarter round is a chain
// of twelve dependent instructions, and four chains leave the vector units idle part of
// the time (docs/benchmarks.md, "Measurements behind design choices"; BenchmarkEngine).
// Registers run out after the rounds, so B's words 12..15 wait on the stack while A is
// finished (feed-forward, transposition, XOR) with Z28..31 as temporaries; then B, with
// Z0..3. The counter lanes are computed again where they are added back. Same arguments
// and contract as xorAVX512, with n a multiple of 2048.
const wideFrame = 256 // B's words 12..15 during A's output

func (g *gen) avx512Wide() {
	g.prologue("xorAVX512W", wideFrame, true)
	g.op("KMOVW R10, K2")
	z := func(group, w int) string { return reg("Z", 16*group+w) }
	// counters sets lo, hi to group's counter lanes: st[12]+16·group+i, and st[13] plus
	// the carry out of the low word when ctr64.
	counters := func(group int, lo, hi string) {
		iota := fmt.Sprintf("iota%d<>(SB)", 16*group)
		g.op("VPBROADCASTD BX, %s", lo)
		g.op("VPADDD %s, %s, %s", iota, lo, lo)
		g.op("VPCMPUD $1, %s, %s, K1", iota, lo) // lo < 16·group+i: the low word wrapped
		g.op("KANDW K2, K1, K1")
		g.op("VPBROADCASTD R8, %s", hi)
		g.op("VPADDD.BCST one<>(SB), %s, K1, %s", hi, hi)
	}
	g.line("wide_chunk:")
	for grp := 0; grp < 2; grp++ {
		counters(grp, z(grp, 12), z(grp, 13))
		for i := 0; i < 16; i++ {
			if i != 12 && i != 13 {
				g.op("VPBROADCASTD %d(R9), %s", 4*i, z(grp, i))
			}
		}
	}
	rot := func(g *gen, r string, n, _ int) { g.op("VPROLD $%d, %s, %s", n, r, r) }
	col := func(grp int) []quarter {
		var qs []quarter
		for c := 0; c < 4; c++ {
			qs = append(qs, quarter{z(grp, c), z(grp, 4+c), z(grp, 8+c), z(grp, 12+c)})
		}
		return qs
	}
	diag := func(grp int) []quarter {
		var qs []quarter
		for c := 0; c < 4; c++ {
			qs = append(qs, quarter{z(grp, c), z(grp, 4+(c+1)%4), z(grp, 8+(c+2)%4), z(grp, 12+(c+3)%4)})
		}
		return qs
	}
	both := func(f func(int) []quarter) []quarter { return append(f(0), f(1)...) }
	g.op("TESTL R10, R10")
	g.op("JNZ wide_first64")
	for grp := 0; grp < 2; grp++ {
		g.op("VPBROADCASTD 52(R9), %s", z(grp, 13)) // column 1 done by the caller
	}
	g.rounds(append(col(0)[:1], col(1)[:1]...), "VPADDD", "VPXORD", rot)
	g.op("JMP wide_diagonal")
	g.line("wide_first64:")
	g.rounds(append(col(0)[:2], col(1)[:2]...), "VPADDD", "VPXORD", rot)
	g.line("wide_diagonal:")
	g.rounds(both(diag), "VPADDD", "VPXORD", rot)
	g.op("MOVQ DX, R11")
	g.op("DECQ R11")
	g.op("JZ wide_rounds_done")
	g.line("wide_round:")
	g.rounds(both(col), "VPADDD", "VPXORD", rot)
	g.rounds(both(diag), "VPADDD", "VPXORD", rot)
	g.op("DECQ R11")
	g.op("JNZ wide_round")
	g.line("wide_rounds_done:")
	for w := 12; w < 16; w++ {
		g.op("VMOVDQU32 %s, %d(SP)", z(1, w), 64*(w-12))
	}
	g.wideOutput(0, [4]string{"Z28", "Z29", "Z30", "Z31"}, counters)
	for w := 12; w < 16; w++ {
		g.op("VMOVDQU32 %d(SP), %s", 64*(w-12), z(1, w))
	}
	g.wideOutput(1, [4]string{"Z0", "Z1", "Z2", "Z3"}, counters)
	g.op("ADDQ $2048, SI")
	g.op("ADDQ $2048, DI")
	g.op("ADDL $32, BX")
	g.op("SBBL R11, R11") // -carry
	g.op("ANDL R10, R11")
	g.op("SUBL R11, R8")
	g.op("SUBQ $2048, CX")
	g.op("JNZ wide_chunk")
	g.op("VPXORD Z0, Z0, Z0")
	for off := 0; off < wideFrame; off += 64 {
		g.op("VMOVDQU32 Z0, %d(SP)", off)
	}
	g.wipeRet(true, 0)
	g.line("")
}

// wideOutput finishes group grp of xorAVX512W: adds the input state back (the counter
// lanes computed into two of the temporaries t), then xorOut16.
func (g *gen) wideOutput(grp int, t [4]string, counters func(int, string, string)) {
	z := func(w int) string { return reg("Z", 16*grp+w) }
	counters(grp, t[0], t[1])
	for i := 0; i < 16; i++ {
		switch i {
		case 12:
			g.op("VPADDD %s, %s, %s", t[0], z(12), z(12))
		case 13:
			g.op("VPADDD %s, %s, %s", t[1], z(13), z(13))
		default:
			g.op("VPADDD.BCST %d(AX), %s, %s", 4*i, z(i), z(i))
		}
	}
	g.xorOut16(16*grp, t, 1024*grp)
}

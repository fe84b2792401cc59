//go:build amd64 && !purego

package poly1305

import "encoding/binary"

// manyState is the multi-message kernels' argument block: its offsets are fixed in
// _asm/many.go (TestManyStateLayout checks them). Lane laneOf(k) of every vector
// belongs to message k of its group.
type manyState struct {
	r    [2][5][8]uint64            // per group: r0, r1, r2, s1 = 20·r1, s2 = 20·r2
	ad   [2][maxManyAD][2][8]uint64 // per group and block of padded ad: low, high words
	adN  uint64                     // blocks of padded ad
	lens [2]uint64                  // len(ad), len(ct)
	h    [2][3][8]uint64            // out: per group, h's limbs (partly reduced)
}

// maxManyAD is the most ad blocks the multi-message kernels take (64 bytes).
const maxManyAD = 4

//go:noescape
func polyMany8(st *manyState, ct *byte, stride, blocks, skew int)

//go:noescape
func polyMany16(st *manyState, ct *byte, stride, blocks, skew int)

// skewMany is how many blocks polyMany16's second group runs ahead of the first. With
// messages 2 KiB or more apart, the two groups' sixteen loads of a step fall in at most
// two sets of the L1 cache's 64 (in one, when the stride is a multiple of 4 KiB, where
// 8 ways cannot hold them, and 4 KiB sectors ran slower than one-by-one SumAEAD:
// BenchmarkSumAEADMany; docs/benchmarks.md, "Measurements behind design choices"); 16 blocks
// (four cache lines) apart they fall in different sets, with room for the next-line
// prefetch. Shorter messages are spread over sets by the stride itself.
func skewMany(ctLen int) int {
	if ctLen >= 2048 {
		return 16
	}
	return 0
}

// manyIFMA is sumAEADMany's vector path for 8·groups messages: the caller has checked
// that ct is whole blocks and ad at most maxManyAD of them.
func manyIFMA(groups int, tags, keys, ads []byte, adLen int, cts []byte, ctLen int) {
	var st manyState
	n := 8 * groups
	for i := range n {
		g, l := i/8, laneOf(i%8)
		limbs := rLimbs((*[32]byte)(keys[32*i:]))
		st.r[g][0][l], st.r[g][1][l], st.r[g][2][l] = limbs[0], limbs[1], limbs[2]
		st.r[g][3][l], st.r[g][4][l] = 20*limbs[1], 20*limbs[2]
		ad := ads[adLen*i : adLen*(i+1)]
		for b := 0; 16*b < adLen; b++ {
			var blk [16]byte
			copy(blk[:], ad[16*b:])
			st.ad[g][b][0][l] = binary.LittleEndian.Uint64(blk[0:8])
			st.ad[g][b][1][l] = binary.LittleEndian.Uint64(blk[8:16])
		}
	}
	st.adN = uint64((adLen + 15) / 16)
	st.lens = [2]uint64{uint64(adLen), uint64(ctLen)}
	var ct *byte
	if len(cts) > 0 {
		ct = &cts[0]
	}
	if groups == 2 {
		polyMany16(&st, ct, ctLen, ctLen/16, skewMany(ctLen))
	} else {
		polyMany8(&st, ct, ctLen, ctLen/16, 0)
	}
	for i := range n {
		g, l := i/8, laneOf(i%8)
		// Limbs below 2^44, 2^44+2^12 and 2^42 join to h2 ≤ 4, as finish needs.
		h0, h1, h2 := join44(st.h[g][0][l], st.h[g][1][l], st.h[g][2][l])
		finish((*[16]byte)(tags[16*i:]), (*[32]byte)(keys[32*i:]), h0, h1, h2)
	}
	st = manyState{} // one-time keys
}

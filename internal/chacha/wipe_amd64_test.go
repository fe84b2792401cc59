//go:build amd64 && !purego

package chacha

import (
	"testing"

	"github.com/elidisk/eli/internal/vecregs"
	"golang.org/x/sys/cpu"
)

// TestKernelsWipeRegisters: every kernel leaves the vector registers it can use zero, since
// they held key-derived state and keystream: all 32 for the AVX-512 kernels, the 16 of
// AVX2 for the others (xorAVX2, xorAVX512W and hchachaManyAVX2 also clear their stack
// frames, which this test cannot see). Each kernel runs right after the registers were filled with a
// pattern, so a kernel that merely did not touch a register it could use fails too.
func TestKernelsWipeRegisters(t *testing.T) {
	if !vecregs.Supported {
		t.Skip("needs AVX-512F to read ZMM16-31")
	}
	var st, pre [16]uint32
	for i := range st {
		st[i] = uint32(i)*0x01010101 + 1
		pre[i] = st[i] ^ 0x5a5a5a5a
	}
	buf := make([]byte, 2048)
	nonces := make([]byte, 16*16)
	out := make([]byte, 16*32)
	var sub [8]uint32
	var in [16][16]uint32
	var first [8][16]uint32
	avx512 := cpu.X86.HasAVX512F && cpu.X86.HasAVX512VL
	kernels := []struct {
		name string
		ok   bool
		regs int // ZMM0..regs-1 must be zero
		run  func()
	}{
		{"xorAVX2", cpu.X86.HasAVX2, 16, func() { xorAVX2(&st, &buf[0], &buf[0], 1024, 20, false) }},
		{"xorAVX512", avx512, 32, func() { xorAVX512(&st, &pre, &buf[0], &buf[0], 2048, 20, true) }},
		{"xorAVX512W", avx512, 32, func() { xorAVX512W(&st, &pre, &buf[0], &buf[0], 2048, 20, true) }},
		{"xorAVX512VL8", avx512, 32, func() { xorAVX512VL8(&st, &buf[0], &buf[0], 1024, 20, false) }},
		{"hchachaAVX2", cpu.X86.HasAVX2, 16, func() { hchachaAVX2(&st, &sub, 20) }},
		{"hchachaAVX512", avx512, 32, func() { hchachaAVX512(&st, &sub, 20) }},
		{"hchachaManyAVX512", avx512, 32, func() { hchachaManyAVX512(&st, &nonces[0], &out[0], 16, 20) }},
		{"hchachaManyAVX512VL8", avx512, 32, func() { hchachaManyAVX512VL8(&st, &nonces[0], &out[0], 8, 20) }},
		{"hchachaManyAVX2", cpu.X86.HasAVX2, 16, func() { hchachaManyAVX2(&st, &nonces[0], &out[0], 8, 20) }},
		{"firstBlocksAVX512", avx512, 32, func() { firstBlocksAVX512(&in, &first, 20) }},
	}
	for _, k := range kernels {
		if !k.ok {
			continue // the CPU lacks it (the test still needs AVX-512F to run at all)
		}
		if nz := vecregs.After(k.run).Nonzero(k.regs, 64); len(nz) > 0 {
			t.Errorf("%s left registers %v not zero (it may use 0 to %d)", k.name, nz, k.regs-1)
		}
	}
}

//go:build amd64 && !purego

package aesxts

import (
	"testing"

	"github.com/elidisk/eli/internal/vecregs"
	"golang.org/x/sys/cpu"
)

// TestKernelsWipeRegisters: the kernels leave no round keys, tweaks or data in the
// vector registers they may use, as chacha's and poly1305's do: the VAES kernels ZMM0 to
// ZMM30 (ZMM31 holds the public XTS polynomial), the AES-NI ones, which use legacy SSE
// encodings, the low 128 bits of the sixteen XMM registers (SSE leaves the rest alone).
func TestKernelsWipeRegisters(t *testing.T) {
	if !vecregs.Supported {
		t.Skip("needs AVX-512F to read ZMM16-31")
	}
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i*29 + 3)
	}
	var k, kd, tk, tkd schedule
	buf := make([]byte, 4*4096)
	kernels := []struct {
		name string
		ok   bool
		regs int  // ZMM0..regs-1 must be zero
		xmm  bool // only their low 16 bytes
		run  func()
	}{
		{"expandKeyAESNI", cpu.X86.HasAES, 16, true, func() { expandKeyAESNI(&key[0], 14, &k, &kd) }},
		{"encAESNI", cpu.X86.HasAES, 16, true, func() { encAESNI(&k, &tk, 14, &buf[0], &buf[0], 4096, 4, 7) }},
		{"decAESNI", cpu.X86.HasAES, 16, true, func() { decAESNI(&kd, &tk, 14, &buf[0], &buf[0], 4096, 4, 7) }},
		{"encVAES512", hasVAES512, 31, false, func() { encVAES512(&k, &tk, 14, &buf[0], &buf[0], 4096, 4, 7) }},
		{"decVAES512", hasVAES512, 31, false, func() { decVAES512(&kd, &tk, 14, &buf[0], &buf[0], 4096, 4, 7) }},
	}
	if cpu.X86.HasAES {
		expandKeyAESNI(&key[0], 14, &tk, &tkd)
	}
	for _, kn := range kernels {
		if !kn.ok {
			continue // the CPU lacks it
		}
		width := 64
		if kn.xmm {
			width = 16
		}
		if nz := vecregs.After(kn.run).Nonzero(kn.regs, width); len(nz) > 0 {
			t.Errorf("%s left registers %v not zero (it may use 0 to %d, the first %d bytes)", kn.name, nz, kn.regs-1, width)
		}
	}
}

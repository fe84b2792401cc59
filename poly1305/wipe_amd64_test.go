//go:build amd64 && !purego

package poly1305

import (
	"testing"

	"github.com/elidisk/eli/internal/vecregs"
)

// TestKernelWipesRegisters: the IFMA kernel holds powers of the one-time key and the
// message sums in vector registers; it must leave every one of them zero.
func TestKernelWipesRegisters(t *testing.T) {
	if !ifma || !vecregs.Supported {
		t.Skip("needs AVX-512 IFMA")
	}
	key := new([32]byte)
	for i := range key {
		key[i] = byte(i + 1)
	}
	for _, n := range []int{0, 16, 100, 512, 4096} {
		msg := make([]byte, n)
		for i := range msg {
			msg[i] = byte(i * 7)
		}
		// hashIFMA does only integer arithmetic after the kernel returns, so the
		// registers read here are as the kernel left them.
		var buf [4 * 128]byte
		regs := vecregs.After(func() { hashIFMA(buf[:], key, []byte("additional data"), msg, true) })
		if nz := regs.Nonzero(32, 64); len(nz) > 0 {
			t.Errorf("%d-byte message: registers %v not zero after the kernel", n, nz)
		}
	}
}

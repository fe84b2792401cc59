//go:build amd64 && !purego

package poly1305

import (
	"testing"
	"unsafe"

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

// TestManyKernelsWipeRegisters: the same for the multi-message kernels, which hold
// sixteen one-time keys' r in their lanes.
func TestManyKernelsWipeRegisters(t *testing.T) {
	if !ifma || !vecregs.Supported {
		t.Skip("needs AVX-512 IFMA")
	}
	for _, groups := range []int{1, 2} {
		n := 8 * groups
		keys := make([]byte, 32*n)
		for i := range keys {
			keys[i] = byte(i*5 + 1)
		}
		ads := make([]byte, 42*n)
		cts := make([]byte, 512*n)
		for i := range cts {
			cts[i] = byte(i * 7)
		}
		tags := make([]byte, 16*n)
		// manyIFMA does only integer arithmetic after the kernel returns.
		regs := vecregs.After(func() { manyIFMA(groups, tags, keys, ads, 42, cts, 512) })
		if nz := regs.Nonzero(32, 64); len(nz) > 0 {
			t.Errorf("%d messages: registers %v not zero after the kernel", n, nz)
		}
	}
}

// TestManyStateLayout: manyState's fields sit where _asm/many.go's kernels look.
func TestManyStateLayout(t *testing.T) {
	var st manyState
	for _, f := range []struct {
		name      string
		got, want uintptr
	}{
		{"r", unsafe.Offsetof(st.r), 0},
		{"ad", unsafe.Offsetof(st.ad), 640},
		{"adN", unsafe.Offsetof(st.adN), 1664},
		{"lens", unsafe.Offsetof(st.lens), 1672},
		{"h", unsafe.Offsetof(st.h), 1688},
	} {
		if f.got != f.want {
			t.Errorf("manyState.%s at %d, the kernels read it at %d", f.name, f.got, f.want)
		}
	}
}

// Package vecregs reads and fills the amd64 vector registers, for the tests that check
// that eli's assembly kernels leave no key-derived values in them. It needs AVX-512F
// (Supported).
package vecregs

import "runtime"

// Regs holds ZMM0 to ZMM31.
type Regs [32][64]byte

// After fills every register with a pattern, runs f and returns the registers as f left
// them, on one OS thread so that nothing else runs in between.
func After(f func()) *Regs {
	r := new(Regs) // before Fill: allocating may use vector registers
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	Fill(0xa5)
	f()
	Read(r)
	return r
}

// Nonzero lists the registers among ZMM0 to ZMM(regs-1) whose first width bytes are not
// all zero (width 16 for the XMM part, 64 for the whole register).
func (r *Regs) Nonzero(regs, width int) []int {
	var out []int
	for i := range r[:regs] {
		for _, b := range r[i][:width] {
			if b != 0 {
				out = append(out, i)
				break
			}
		}
	}
	return out
}

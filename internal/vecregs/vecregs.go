// Package vecregs reads and fills the amd64 vector registers, for the tests that check
// that eli's assembly kernels leave no key-derived values in them. Fill and Read need
// AVX-512F (Supported); the caller must hold its OS thread (runtime.LockOSThread), so
// that no other goroutine runs between the call it checks and Read.
package vecregs

// Regs holds ZMM0 to ZMM31.
type Regs [32][64]byte

// Nonzero lists the registers that are not all zero.
func (r *Regs) Nonzero() []int {
	var out []int
	for i := range r {
		for _, b := range r[i] {
			if b != 0 {
				out = append(out, i)
				break
			}
		}
	}
	return out
}

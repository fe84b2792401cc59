//go:build !amd64 || purego

package vecregs

// Supported is false: there is no assembly for this architecture (or build).
var Supported = false

func Fill(b byte)  { panic("vecregs: not supported") }
func Read(r *Regs) { panic("vecregs: not supported") }

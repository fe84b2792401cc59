//go:build !purego

package vecregs

import "golang.org/x/sys/cpu"

// Supported reports whether Fill and Read can run here.
var Supported = cpu.X86.HasAVX512F

// Fill sets every byte of ZMM0 to ZMM31 to b. The caller must hold its OS thread
// (runtime.LockOSThread) until it has read them.
//
//go:noescape
func Fill(b byte)

// Read stores ZMM0 to ZMM31 in r.
//
//go:noescape
func Read(r *Regs)

//go:build amd64 && !purego

package poly1305

import "golang.org/x/sys/cpu"

var defaultPath = pickPath()

// ifma: the kernel uses AVX-512F and IFMA instructions; VL is asked for as well because
// every CPU with IFMA has it and the brief for this package names it.
var ifma = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VL && cpu.X86.HasAVX512IFMA

func pickPath() path {
	if ifma {
		return pathIFMA
	}
	return pathGeneric
}

// paths lists every path this machine can run, generic first.
func paths() []path {
	if ifma {
		return []path{pathGeneric, pathIFMA}
	}
	return []path{pathGeneric}
}

func sumAEAD(p path, tag *[16]byte, key *[32]byte, ad, ct []byte) {
	if p == pathIFMA {
		sumIFMA(tag, key, ad, ct)
		return
	}
	sumGeneric(tag, key, ad, ct)
}

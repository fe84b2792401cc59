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

func sumAEADMany(p path, tags, keys, ads []byte, adLen int, cts []byte, ctLen int) {
	n := checkMany(tags, keys, ads, adLen, cts, ctLen)
	i := 0
	if p == pathIFMA && ctLen%16 == 0 && adLen <= 16*maxManyAD {
		for n-i >= 8 {
			groups := min(2, (n-i)/8)
			m := 8 * groups
			manyIFMA(groups, tags[16*i:16*(i+m)], keys[32*i:32*(i+m)], ads[adLen*i:adLen*(i+m)], adLen, cts[ctLen*i:ctLen*(i+m)], ctLen)
			i += m
		}
	}
	sumAEADManyOneByOne(p, tags[16*i:], keys[32*i:], ads[adLen*i:], adLen, cts[ctLen*i:], ctLen)
}

//go:build !amd64 || purego

package poly1305

const defaultPath = pathGeneric

func paths() []path { return []path{pathGeneric} }

func sumAEAD(_ path, tag *[16]byte, key *[32]byte, ad, ct []byte) {
	sumGeneric(tag, key, ad, ct)
}

func sumAEADMany(p path, tags, keys, ads []byte, adLen int, cts []byte, ctLen int) {
	checkMany(tags, keys, ads, adLen, cts, ctLen)
	sumAEADManyOneByOne(p, tags, keys, ads, adLen, cts, ctLen)
}

package chacha

// engine names one implementation of the bulk keystream XOR. Every engine produces the
// same bytes; tests run each one the machine supports, whatever defaultEngine is.
type engine uint8

const (
	engineGeneric engine = iota // pure Go, one block at a time
	engineAVX2                  // 8 blocks per step
	engineAVX512                // 16 blocks per step (8 for a 512-byte remainder)
)

func (e engine) String() string {
	switch e {
	case engineGeneric:
		return "generic"
	case engineAVX2:
		return "avx2"
	case engineAVX512:
		return "avx512"
	}
	return "unknown"
}

// Implementation reports which keystream implementation this process uses: "avx512",
// "avx2" or "generic". It exists for benchmark reports and logs.
func Implementation() string { return defaultEngine.String() }

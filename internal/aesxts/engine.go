package aesxts

// engine names one implementation of XTS. Every engine produces the same bytes; tests
// run each one the machine supports, whatever defaultEngine is.
type engine uint8

const (
	engineGeneric engine = iota // golang.org/x/crypto/xts over crypto/aes
	engineAESNI                 // AES-NI on XMM registers, 8 blocks in flight
	engineVAES512               // VAES on ZMM registers, 16 blocks in flight
)

func (e engine) String() string {
	switch e {
	case engineGeneric:
		return "generic"
	case engineAESNI:
		return "aesni"
	case engineVAES512:
		return "vaes-avx512"
	}
	return "unknown"
}

// Implementation reports which implementation New uses in this process: "vaes-avx512",
// "aesni" or "generic" (golang.org/x/crypto/xts). It exists for benchmark reports and
// logs.
func Implementation() string { return defaultEngine.String() }

package chacha

import (
	"crypto/rand"
	"testing"
	"unsafe"

	"github.com/elidisk/eli/internal/wipe"
)

const paintBytes = 64 << 10

// paint fills paintBytes of the stack below its caller with v.
//
//go:noinline
func paint(v byte) {
	var b [paintBytes]byte
	for i := range b {
		b[i] = v
	}
	keepPaint(&b)
}

//go:noinline
func keepPaint(b *[paintBytes]byte) {}

// stackUse is how many bytes of the stack below its own frame f wrote: the stack is
// painted, f runs, and the painted region is read back through unsafe pointers, below
// the stack pointer where nothing else writes meanwhile (signals have their own stack).
// checkptr (-race) refuses pointers below the stack pointer, which is what this reads.
//
//go:noinline
//go:nocheckptr
func stackUse(f func()) int {
	paint(0xa5) // grows the stack, if it must, before anything is measured
	paint(0xa5)
	f()
	var marker byte
	base := unsafe.Pointer(&marker)
	use := 0
	for off := 1; off <= paintBytes; off++ {
		if *(*byte)(unsafe.Add(base, -off)) != 0xa5 {
			use = off
		}
	}
	return use
}

// TestKeyedCallsFitTheStackWipe: every worker that holds a key on the stack uses less of
// it than wipe.Stack zeroes, for every engine and the sizes sectors come in, so the wipe
// before the call leaves room for it (no growth, which would copy the key into a freed
// stack) and the wipe after covers all it wrote.
func TestKeyedCallsFitTheStackWipe(t *testing.T) {
	var key [KeySize]byte
	rand.Read(key[:])
	deepest := 0
	for _, e := range engines() {
		for _, n := range []int{1, 2, 16, 33} {
			nonces := make([]byte, n*NonceSizeX)
			rand.Read(nonces)
			sub, pk := make([]byte, n*SubkeySize), make([]byte, n*PolyKeySize)
			src := make([]byte, n*4096)
			dst := make([]byte, len(src))
			var n12 [NonceSize]byte
			var n24 [NonceSizeX]byte
			for name, f := range map[string]func(){
				"xaeadKeys":       func() { xaeadKeys(e, &key, nonces, sub, pk) },
				"xorMany 12":      func() { xorMany(e, 20, &key, NonceSize, nonces[:n*NonceSize], dst, src) },
				"xorMany 24":      func() { xorMany(e, 20, &key, NonceSizeX, nonces, dst, src) },
				"hChaChaMany":     func() { hChaChaMany(20, &key, nonces[:n*HNonceSize], sub) },
				"xorKeyStreamAt":  func() { xorKeyStreamAt(20, &key, &n12, 0, dst[:4096], src[:4096]) },
				"xorKeyStreamXAt": func() { xorKeyStreamXAt(20, &key, &n24, 0, dst[:4096], src[:4096]) },
			} {
				if use := stackUse(f); use > deepest {
					deepest = use
					t.Logf("%s, %s, %d messages: %d bytes of stack", e, name, n, use)
				}
			}
		}
	}
	// A margin for the frames between the measured call and a wrapper's (closures here).
	if deepest+512 > wipe.StackBytes {
		t.Errorf("a keyed call uses %d bytes of stack; wipe.Stack zeroes %d", deepest, wipe.StackBytes)
	}
}

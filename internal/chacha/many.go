package chacha

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/elidisk/eli/internal/wipe"
)

// hSubkeySize is the length of one HChaCha subkey, the output of HChaChaMany per nonce.
const hSubkeySize = 32

// manyChunk is how many messages XORKeyStreamXMany derives subkeys for at once: one
// AVX-512 pass (two AVX2 ones), and a stack buffer that stays small.
const manyChunk = 16

// HChaChaMany writes HChaCha(rounds, key, nonce) for each 16-byte nonce of nonces into
// out, 32 bytes per nonce, in order: n = len(nonces)/16 subkeys in one call. The SIMD
// engines compute 8 or 16 of them at once, one per vector lane, where HChaCha on its own
// is one long dependency chain that vector units cannot shorten; this is what makes
// XChaCha over many short messages (disk sectors) cost about what ChaCha does. It
// allocates nothing. It panics if rounds is not 8, 12 or 20, if len(nonces) is not a
// multiple of 16, if len(out) is not 2·len(nonces), or if out and nonces overlap.
func HChaChaMany(rounds int, key *[KeySize]byte, nonces, out []byte) {
	wipe.Stack()
	hChaChaMany(rounds, key, nonces, out)
	wipe.Stack()
}

//go:noinline
func hChaChaMany(rounds int, key *[KeySize]byte, nonces, out []byte) {
	if err := checkRounds(rounds); err != nil {
		panic(err.Error())
	}
	if len(nonces)%HNonceSize != 0 {
		panic(fmt.Sprintf("chacha: HChaChaMany given %d bytes of nonces, not a multiple of %d", len(nonces), HNonceSize))
	}
	if len(out) != len(nonces)/HNonceSize*hSubkeySize {
		panic(fmt.Sprintf("chacha: HChaChaMany output is %d bytes, want %d for %d nonces", len(out), len(nonces)/HNonceSize*hSubkeySize, len(nonces)/HNonceSize))
	}
	if overlap(nonces, out) {
		panic("chacha: HChaChaMany output overlaps its nonces")
	}
	if len(nonces) == 0 {
		return
	}
	var st [16]uint32
	initState(&st, key)
	hchachaManyEngine(defaultEngine, &st, rounds, nonces, out)
	clear(st[4:12])
}

// XORKeyStreamMany XORs src into dst as n = len(nonces)/12 consecutive messages of
// len(src)/n bytes each, message i with the RFC 8439 keystream of (rounds, key,
// nonces[12i:12i+12]) from block 0: the bytes of n XORKeyStreamAt calls with counter 0,
// for runs of disk sectors with one nonce per sector. It allocates nothing. It panics
// where XORKeyStreamXMany does.
func XORKeyStreamMany(rounds int, key *[KeySize]byte, nonces, dst, src []byte) {
	wipe.Stack()
	xorMany(defaultEngine, rounds, key, NonceSize, nonces, dst, src)
	wipe.Stack()
}

// XORKeyStreamXMany XORs src into dst as n = len(nonces)/24 consecutive messages of
// len(src)/n bytes each, message i with the XChaCha keystream of (rounds, key,
// nonces[24i:24i+24]) from block 0: the bytes of n XORKeyStreamXAt calls with counter 0,
// with the n HChaCha subkeys computed by HChaChaMany's batch kernels instead of one at a
// time. It is meant for runs of disk sectors, one nonce per sector, from many goroutines;
// it allocates nothing and wipes the subkeys it made. It panics if rounds is not 8, 12
// or 20, if len(nonces) is not a multiple of 24, if len(src) is not a multiple of n (0
// when n is 0), if dst is shorter than src, if dst and src overlap inexactly, if nonces
// overlaps dst, or if a message is longer than a 32-bit counter reaches (256 GiB).
func XORKeyStreamXMany(rounds int, key *[KeySize]byte, nonces, dst, src []byte) {
	wipe.Stack()
	xorMany(defaultEngine, rounds, key, NonceSizeX, nonces, dst, src)
	wipe.Stack()
}

// xorMany is XORKeyStreamMany (nonceSize 12) and XORKeyStreamXMany (24) on engine e.
//
//go:noinline
func xorMany(e engine, rounds int, key *[KeySize]byte, nonceSize int, nonces, dst, src []byte) {
	m := checkMany(rounds, nonceSize, nonces, dst, src)
	if m == 0 {
		return
	}
	n := len(nonces) / nonceSize
	var ms [16]uint32
	if nonceSize == NonceSize {
		initState(&ms, key)
		for i := range n {
			nonce := nonces[i*NonceSize : (i+1)*NonceSize]
			ms[12] = 0
			ms[13] = binary.LittleEndian.Uint32(nonce[0:])
			ms[14] = binary.LittleEndian.Uint32(nonce[4:])
			ms[15] = binary.LittleEndian.Uint32(nonce[8:])
			xorKeyStream(e, &ms, rounds, false, dst[i*m:(i+1)*m], src[i*m:(i+1)*m])
		}
		clear(ms[4:12])
		return
	}
	var st [16]uint32
	initState(&st, key)
	var hn [manyChunk * HNonceSize]byte
	var sub [manyChunk * hSubkeySize]byte
	for i := 0; i < n; i += manyChunk {
		c := min(manyChunk, n-i)
		for j := range c {
			// A fixed-size copy is two moves, not a memmove call per nonce.
			*(*[HNonceSize]byte)(hn[j*HNonceSize:]) = *(*[HNonceSize]byte)(nonces[(i+j)*NonceSizeX:])
		}
		hchachaManyEngine(e, &st, rounds, hn[:c*HNonceSize], sub[:c*hSubkeySize])
		for j := range c {
			// The XChaCha state (draft-irtf-cfrg-xchacha-03 §2.3): the subkey as key,
			// counter 0, nonce 0x00000000 ‖ nonce[16:24].
			initState(&ms, (*[KeySize]byte)(sub[j*hSubkeySize:]))
			tail := nonces[(i+j)*NonceSizeX+16:]
			ms[12], ms[13] = 0, 0
			ms[14] = binary.LittleEndian.Uint32(tail[0:])
			ms[15] = binary.LittleEndian.Uint32(tail[4:])
			at := (i + j) * m
			xorKeyStream(e, &ms, rounds, false, dst[at:at+m], src[at:at+m])
		}
	}
	clear(sub[:])
	clear(ms[4:12])
	clear(st[4:12])
}

// checkMany panics on arguments the many-message calls refuse (see XORKeyStreamXMany)
// and returns the length of one message, 0 when there is nothing to do.
func checkMany(rounds, nonceSize int, nonces, dst, src []byte) int {
	if err := checkRounds(rounds); err != nil {
		panic(err.Error())
	}
	if len(nonces)%nonceSize != 0 {
		panic(fmt.Sprintf("chacha: given %d bytes of nonces, not a multiple of %d", len(nonces), nonceSize))
	}
	n := len(nonces) / nonceSize
	if (n == 0 && len(src) != 0) || (n > 0 && len(src)%n != 0) {
		panic(fmt.Sprintf("chacha: cannot split %d bytes into %d equal messages", len(src), n))
	}
	if len(dst) < len(src) {
		panic("chacha: output smaller than input")
	}
	dst = dst[:len(src)]
	if inexactOverlap(dst, src) {
		panic("chacha: invalid buffer overlap")
	}
	if overlap(nonces, dst) {
		panic("chacha: output overlaps the nonces")
	}
	if len(src) == 0 {
		return 0
	}
	m := len(src) / n
	if uint64(m) > BlockSize<<32 {
		panic(fmt.Sprintf("%s (%d-byte messages)", exhausted, m))
	}
	return m
}

// overlap reports whether x and y share any byte.
func overlap(x, y []byte) bool {
	if len(x) == 0 || len(y) == 0 {
		return false
	}
	xs, ys := uintptr(unsafe.Pointer(&x[0])), uintptr(unsafe.Pointer(&y[0]))
	return xs <= ys+uintptr(len(y)-1) && ys <= xs+uintptr(len(x)-1)
}

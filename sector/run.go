package sector

import (
	"fmt"
	"unsafe"
)

// Runner is implemented by every length-preserving codec (MetaSize 0): it transforms a
// run of consecutive sectors in one call. Its output is exactly what Seal and Open give
// sector by sector; the point is the cost. xchacha*-xts derives one HChaCha subkey per
// sector, which alone is a long chain of dependent operations, and a run lets it compute
// 8 or 16 of them at once in vector lanes (chacha.XORKeyStreamXMany). The other codecs
// loop over Seal's work. blockdev/ hands it the runs of sectors of each request and
// refuses a length-preserving codec without it.
type Runner interface {
	// SealRun encrypts the len(src)/SectorSize() sectors of src, the first with index
	// first and the others with the following indexes (modulo 2^64), into dst. dst and
	// src have the same length, a multiple of the sector size, and are either the same
	// slice (in place) or do not overlap; it panics otherwise, before writing anything.
	SealRun(first uint64, dst, src []byte)
	// OpenRun decrypts likewise. On lengths or an overlap SealRun panics on, it returns
	// an error and writes nothing.
	OpenRun(first uint64, dst, src []byte) error
}

var (
	_ Runner = (*chachaXTS)(nil)
	_ Runner = (*aesXTS)(nil)
	_ Runner = noneCodec{}
)

// checkRun reports dst and src that are not a run of whole sectors of one length, or
// that overlap other than exactly.
func checkRun(m Mode, size int, dst, src []byte) error {
	if len(src)%size != 0 || len(dst) != len(src) {
		return fmt.Errorf("sector: %s codec given a run of %d bytes into %d, need equal lengths that are a multiple of its sector size %d", m, len(src), len(dst), size)
	}
	if inexactOverlap(dst, src) {
		return fmt.Errorf("sector: %s codec given a run whose source and destination overlap but do not coincide", m)
	}
	return nil
}

func mustRun(m Mode, size int, dst, src []byte) {
	if err := checkRun(m, size, dst, src); err != nil {
		panic(err.Error())
	}
}

// inexactOverlap reports whether x and y share memory without starting at the same
// address: a shifted overlap would overwrite input before it is read.
func inexactOverlap(x, y []byte) bool {
	if len(x) == 0 || len(y) == 0 || &x[0] == &y[0] {
		return false
	}
	xs, ys := uintptr(unsafe.Pointer(&x[0])), uintptr(unsafe.Pointer(&y[0]))
	return xs <= ys+uintptr(len(y)-1) && ys <= xs+uintptr(len(x)-1)
}

func (c noneCodec) SealRun(_ uint64, dst, src []byte) {
	mustRun(ModeNone, c.size, dst, src)
	if len(dst) > 0 && &dst[0] != &src[0] {
		copy(dst, src)
	}
}

func (c noneCodec) OpenRun(_ uint64, dst, src []byte) error {
	if err := checkRun(ModeNone, c.size, dst, src); err != nil {
		return err
	}
	if len(dst) > 0 && &dst[0] != &src[0] { // in place, as a read opens: nothing to move
		copy(dst, src)
	}
	return nil
}

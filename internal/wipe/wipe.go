// Package wipe zeroes key material that other packages hold and offer no way to clear.
package wipe

import (
	"crypto/cipher"
	"reflect"
	"unsafe"
)

// AEADKey zeroes the key inside an x/crypto chacha20poly1305 AEAD (ChaCha20-Poly1305 or
// XChaCha20-Poly1305). That package keeps the key in its only field, key [32]byte, and
// has no method to clear it, so this reaches it by reflection. It reports whether the
// field was found; the tests fail if an x/crypto upgrade moves it, so that a silent
// no-op cannot ship.
func AEADKey(a cipher.AEAD) bool {
	v := reflect.ValueOf(a)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		return false
	}
	f := v.Elem().FieldByName("key")
	if !f.IsValid() || f.Kind() != reflect.Array || f.Type().Elem().Kind() != reflect.Uint8 {
		return false
	}
	clear(unsafe.Slice((*byte)(unsafe.Pointer(f.UnsafeAddr())), f.Len()))
	return true
}

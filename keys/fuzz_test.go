package keys

import (
	"bytes"
	"errors"
	"os"
	"testing"
)

// FuzzDecode: decoding any bytes neither panics nor accepts a header it would not write
// again; whatever decodes, re-checksummed, decodes to the same fields, and its KDF
// parameters are within bounds.
func FuzzDecode(f *testing.F) {
	golden, err := os.ReadFile(goldenPath)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(golden)
	f.Add(golden[:100])
	f.Add(make([]byte, HeaderSize))
	f.Add(append(bytes.Clone(magic[:]), make([]byte, HeaderSize-len(magic))...))
	f.Fuzz(func(t *testing.T, b []byte) {
		// Let the fuzzer change fields without having to find SHA-256 preimages.
		if len(b) == HeaderSize && bytes.HasPrefix(b, magic[:]) {
			var raw [HeaderSize]byte
			copy(raw[:], b)
			setChecksum(&raw)
			b = raw[:]
		}
		h, err := Decode(b)
		if err != nil {
			if kindOf(err) == nil {
				t.Fatalf("Decode error of no known kind: %v", err)
			}
			if h != nil {
				t.Fatal("Decode returned a header with an error")
			}
			return
		}
		if !bytes.Equal(h.Backup(), b) {
			t.Fatal("Backup differs from the decoded bytes")
		}
		for i, s := range h.Slots {
			if s.Active && s.KDF.Validate() != nil {
				t.Fatalf("slot %d decoded with KDF parameters out of range: %+v", i, s.KDF)
			}
		}
		if err := h.Layout.Validate(h.ProviderSize); err != nil {
			t.Fatalf("decoded layout does not fit its own recorded size: %v", err)
		}
		// A decoded header must be one an unlock can run on without touching unbounded
		// work: wrong credentials fail with a known error.
		if h.ActiveSlots() > 0 {
			cost := 0
			for _, s := range h.Slots {
				if s.Active {
					cost += int(s.KDF.MemoryKiB) * int(s.KDF.Time)
				}
			}
			if cost > 4096 {
				return // bounded, but too slow for a fuzz iteration
			}
			_, _, err := h.Unlock(pass("fuzz"), AnySlot)
			if err == nil {
				t.Fatal("a fuzzed header unlocked")
			}
			if !errors.Is(err, ErrWrongKey) {
				t.Fatalf("Unlock = %v", err)
			}
		}
	})
}

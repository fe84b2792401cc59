package keys

import (
	"bytes"
	"errors"
	"fmt"
	"io"

	"github.com/elidisk/eli/layout"

	"github.com/elidisk/eli/provider"
)

// copyRead is one header copy as found on the provider.
type copyRead struct {
	which Copy
	off   int64
	raw   []byte // nil when the provider has no room for this copy
	h     *Header
	err   error // nil when h is valid and fits the provider
}

// readAt reads len(b) bytes at off; a short read is an error.
func readAt(p provider.Provider, b []byte, off int64) error {
	n, err := p.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("read %d bytes at offset %d: %w", len(b), off, err)
}

func where(off int64) string { return fmt.Sprintf(" at offset %d", off) }

// readCopies reads and checks both header copies. Its error is an I/O error only; what is
// wrong with each copy is in its err.
func readCopies(p provider.Provider) ([2]copyRead, error) {
	size := p.Size()
	cs := [2]copyRead{{which: CopyA, off: 0}, {which: CopyB, off: layout.HeaderBOffset(size)}}
	for i := range cs {
		c := &cs[i]
		if c.off < 0 || size < HeaderSize {
			c.err = newError(ErrNotELI, "no room for header copy %s in a provider of %d bytes", c.which, size)
			continue
		}
		c.raw = make([]byte, HeaderSize)
		if err := readAt(p, c.raw, c.off); err != nil {
			return cs, fmt.Errorf("read header copy %s: %w", c.which, err)
		}
		c.h, c.err = decode(c.raw, where(c.off))
		if c.err == nil {
			if err := c.h.Layout.Validate(size); err != nil {
				c.err = newError(ErrTooSmall, "eli header copy%s does not fit the provider (was it truncated or shrunk? it needs at least %d bytes): %v", where(c.off), c.h.Layout.MinProviderSize(), err)
			}
		}
		if c.err == nil {
			c.h.Copy, c.h.Offset = c.which, c.off
		}
	}
	return cs, nil
}

// Read reads both header copies from p and returns the valid one with the higher
// sequence number; Header.Copy says which, Header.Warning what is wrong with the other.
//
// When no copy is valid the error names what is wrong and wraps ErrNotELI (no eli magic
// in either place; the message says what the provider looks like instead), ErrVersion,
// ErrTooSmall (the provider shrank below the layout) or ErrCorrupt.
func Read(p provider.Provider) (*Header, error) {
	cs, err := readCopies(p)
	if err != nil {
		return nil, err
	}
	return choose(p, cs)
}

// ReadDamaged is Read for inspecting a provider that no longer fits its header (it was
// truncated or shrunk: ErrTooSmall): it returns the newest copy that decodes anyway,
// with Warning saying why it does not fit, so that dump can show what the header says.
// It is never the way to use a volume.
func ReadDamaged(p provider.Provider) (*Header, error) {
	h, err := Read(p)
	if !errors.Is(err, ErrTooSmall) {
		return h, err
	}
	cs, rerr := readCopies(p)
	if rerr != nil {
		return nil, rerr
	}
	var best *copyRead
	for i := range cs {
		c := &cs[i]
		if c.h != nil && errors.Is(c.err, ErrTooSmall) && (best == nil || c.h.Sequence > best.h.Sequence) {
			best = c
		}
	}
	if best == nil {
		return nil, err
	}
	best.h.Copy, best.h.Offset, best.h.Warning = best.which, best.off, best.err
	return best.h, nil
}

func choose(p provider.Provider, cs [2]copyRead) (*Header, error) {
	a, b := &cs[0], &cs[1]
	switch {
	case a.err == nil && b.err == nil:
		switch {
		case a.h.Sequence > b.h.Sequence:
			a.h.Warning = stale(b, a)
			return a.h, nil
		case b.h.Sequence > a.h.Sequence:
			b.h.Warning = stale(a, b)
			return b.h, nil
		case !bytes.Equal(a.raw, b.raw):
			a.h.Warning = newError(ErrCorrupt, "eli header copy%s differs from copy A at the same sequence number %d; copy A is used", where(b.off), a.h.Sequence)
		}
		return a.h, nil
	case a.err == nil:
		a.h.Warning = missingB(p, a.h, b.err)
		return a.h, nil
	case b.err == nil:
		b.h.Warning = a.err
		return b.h, nil
	}

	ka, kb := kindOf(a.err), kindOf(b.err)
	switch {
	case ka == nil:
		return nil, a.err
	case kb == nil:
		return nil, b.err
	case ka == ErrNotELI && kb == ErrNotELI:
		return nil, newError(ErrNotELI, "not an eli provider: no eli header at offset 0 or at the end (%s)", sniff(p, a.raw))
	case ka == ErrVersion:
		return nil, a.err
	case kb == ErrVersion:
		return nil, b.err
	case ka == ErrTooSmall || kb == ErrTooSmall:
		// A header that checks out but does not fit says more than a corrupt one.
		if ka == ErrTooSmall {
			return nil, a.err
		}
		return nil, b.err
	case ka == ErrCorrupt && kb == ErrCorrupt:
		return nil, newError(ErrCorrupt, "both header copies are corrupt (%v; %v)", a.err, b.err)
	}
	return nil, newError(ErrCorrupt, "no valid eli header copy (%v; %v)", a.err, b.err)
}

func stale(old, cur *copyRead) error {
	return newError(ErrStale, "eli header copy%s is older than copy %s (sequence %d < %d)", where(old.off), cur.which, old.h.Sequence, cur.h.Sequence)
}

// missingB explains a bad copy B next to a good copy A; the usual cause is a provider that
// grew without eli resize, which leaves copy B where the old end was.
func missingB(p provider.Provider, a *Header, err error) error {
	if errors.Is(err, ErrNotELI) && a.ProviderSize != p.Size() {
		return fmt.Errorf("%w (the provider's size changed from %d to %d bytes since the header was written; eli resize moves copy B to the new end)",
			err, a.ProviderSize, p.Size())
	}
	return err
}

package nbd

import (
	"errors"
	"fmt"
	"math/bits"
	"strings"
	"unicode/utf8"

	"github.com/elidisk/eli/internal/nbdproto"
)

// Defaults for Export's block sizes (proto.md "Block size constraints").
const (
	defaultMinBlock       = 1
	defaultPreferredBlock = 4096
	defaultMaxBlock       = MaxRequest
)

// export is an Export with its block sizes resolved, checked once when serving starts.
type export struct {
	Export
	size                     int64
	minBlock, prefBlock, max uint32
}

func newExport(e Export) (*export, error) {
	x := &export{Export: e, minBlock: e.MinBlock, prefBlock: e.PreferredBlock, max: e.MaxBlock}
	if e.Backend == nil {
		return nil, fmt.Errorf("export %q has no backend", e.Name)
	}
	if err := checkString("export name", e.Name); err != nil {
		return nil, err
	}
	if err := checkString("export description", e.Description); err != nil {
		return nil, err
	}
	x.size = e.Backend.Size()
	if x.size < 0 {
		return nil, fmt.Errorf("export %q: backend size %d is negative", e.Name, x.size)
	}
	if x.minBlock == 0 {
		x.minBlock = defaultMinBlock
	}
	if x.prefBlock == 0 {
		x.prefBlock = max(defaultPreferredBlock, x.minBlock)
	}
	if x.max == 0 {
		x.max = defaultMaxBlock
	}
	// The rules below are proto.md's for advertised block sizes.
	switch {
	case bits.OnesCount32(x.minBlock) != 1 || x.minBlock > 64<<10:
		return nil, fmt.Errorf("export %q: minimum block size %d must be a power of two no larger than 65536", e.Name, x.minBlock)
	case bits.OnesCount32(x.prefBlock) != 1 || x.prefBlock < max(x.minBlock, 512):
		return nil, fmt.Errorf("export %q: preferred block size %d must be a power of two, at least 512 and the minimum block size", e.Name, x.prefBlock)
	case x.max%x.minBlock != 0 || x.max > MaxRequest:
		return nil, fmt.Errorf("export %q: maximum block size %d must be a multiple of the minimum block size and at most %d", e.Name, x.max, MaxRequest)
	case int64(x.max) < min(int64(x.prefBlock), x.size):
		return nil, fmt.Errorf("export %q: maximum block size %d is below the preferred block size %d", e.Name, x.max, x.prefBlock)
	case x.size%int64(x.minBlock) != 0:
		return nil, fmt.Errorf("export %q: size %d is not a multiple of the minimum block size %d", e.Name, x.size, x.minBlock)
	}
	return x, nil
}

// checkString applies proto.md's rule for strings: UTF-8 without NUL, at most 4096 bytes.
func checkString(what, s string) error {
	switch {
	case len(s) > maxString:
		return fmt.Errorf("%s is %d bytes, longer than the protocol's %d", what, len(s), maxString)
	case strings.IndexByte(s, 0) >= 0:
		return fmt.Errorf("%s contains a NUL byte", what)
	case !utf8.ValidString(s):
		return fmt.Errorf("%s is not valid UTF-8", what)
	}
	return nil
}

// flags are the transmission flags for this export; structured says whether the client
// negotiated structured replies (NBD_FLAG_SEND_DF only makes sense with them).
func (x *export) flags(structured bool) uint16 {
	f := uint16(nbdproto.TflagHasFlags | nbdproto.TflagSendCache)
	if structured {
		// The server always answers a read with one data chunk, so "don't fragment" is free.
		f |= nbdproto.TflagSendDF
	}
	if x.ReadOnly {
		// Without writes every connection sees the same data, so multi-conn is trivially
		// safe for a read-only export.
		return f | nbdproto.TflagReadOnly | nbdproto.TflagCanMultiConn
	}
	f |= nbdproto.TflagSendFlush | nbdproto.TflagSendFUA | nbdproto.TflagSendTrim | nbdproto.TflagSendWriteZeroes | nbdproto.TflagSendFastZero
	if x.MultiConn {
		f |= nbdproto.TflagCanMultiConn
	}
	return f
}

var errNoExports = errors.New("nbd: server has no exports")

// exportTable resolves names; built once per Server.
type exportTable struct {
	list   []*export
	byName map[string]*export
}

func newExportTable(exports []Export) (*exportTable, error) {
	if len(exports) == 0 {
		return nil, errNoExports
	}
	t := &exportTable{byName: make(map[string]*export, len(exports))}
	for _, e := range exports {
		x, err := newExport(e)
		if err != nil {
			return nil, fmt.Errorf("nbd: %w", err)
		}
		if _, dup := t.byName[e.Name]; dup {
			return nil, fmt.Errorf("nbd: two exports are named %q", e.Name)
		}
		t.byName[e.Name] = x
		t.list = append(t.list, x)
	}
	return t, nil
}

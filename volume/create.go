package volume

import (
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/signature"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
)

// OverwriteKind says what CheckOverwrite found on a provider.
type OverwriteKind int

const (
	// LiveVolume: an eli volume with keyslots.
	LiveVolume OverwriteKind = iota
	// DamagedVolume: what looks like an eli volume that does not open (a header
	// backup may bring it back).
	DamagedVolume
	// ForeignData: another format: a filesystem, LUKS, a partition table...
	ForeignData
)

// OverwriteError: the provider holds something a new volume would destroy.
type OverwriteError struct {
	Path string
	Kind OverwriteKind
	What string // "eli volume 0123… (xchacha20-poly1305)", "an ext4 filesystem", ...
}

func (e *OverwriteError) Error() string {
	return fmt.Sprintf("%s holds %s", e.Path, e.What)
}

// CheckOverwrite says whether a new volume may go on h's provider without destroying
// anything of note: nil for a provider that holds nothing eli or package signature
// recognize, or a killed eli volume (whose data nothing can decrypt any more; note says
// so), an *OverwriteError otherwise. Its other errors are I/O errors.
func CheckOverwrite(h *Handle) (note string, err error) {
	p, path := h.Provider(), h.Path()
	hdr, err := keys.Read(p)
	switch {
	case err == nil && hdr.ActiveSlots() == 0:
		return fmt.Sprintf("%s held eli volume %s, killed (no keyslot left): initializing over it",
			path, hex.EncodeToString(hdr.VolumeID[:])), nil
	case err == nil:
		return "", &OverwriteError{Path: path, Kind: LiveVolume,
			What: fmt.Sprintf("eli volume %s (%s)", hex.EncodeToString(hdr.VolumeID[:]), hdr.Mode)}
	case errors.Is(err, keys.ErrNotELI):
		what, rerr := keys.Remnant(p)
		if rerr != nil {
			return "", rerr
		}
		if what != "" {
			return "", &OverwriteError{Path: path, Kind: DamagedVolume, What: "what looks like a damaged eli volume (" + what + ")"}
		}
		found, derr := signature.Detect(p, p.Size())
		if derr != nil {
			return "", derr
		}
		if found != "" {
			return "", &OverwriteError{Path: path, Kind: ForeignData, What: found}
		}
		return "", nil
	case errors.Is(err, keys.ErrCorrupt), errors.Is(err, keys.ErrTooSmall), errors.Is(err, keys.ErrVersion):
		return "", &OverwriteError{Path: path, Kind: DamagedVolume, What: fmt.Sprintf("a damaged or unreadable eli volume (%v)", err)}
	}
	return "", fmt.Errorf("%s: %w", path, err) // an I/O error: overwrite nothing
}

// CreateOptions say what volume Create makes.
type CreateOptions struct {
	Layout      layout.Layout
	Credentials keys.Credentials
	KDF         keys.KDFParams
	// Force overwrites what CheckOverwrite refuses.
	Force bool
}

// Created is what Create made.
type Created struct {
	Header *keys.Header
	// Note says what the provider held before, where that is worth saying (a killed
	// volume overwritten), or is empty.
	Note string
}

// Create makes a new volume on h's provider, opened ReadWrite: it checks what the
// provider holds (CheckOverwrite, unless Force), prepares the metadata area
// (blockdev.Format), and writes a header with a new master key wrapped in keyslot 0.
func Create(h *Handle, o CreateOptions) (*Created, error) {
	if h.access != ReadWrite && h.access != Takeover {
		return nil, fmt.Errorf("%s: a new volume needs the provider opened for writing, not %s", h.Path(), h.access)
	}
	note, err := CheckOverwrite(h)
	if err != nil && (!o.Force || !isOverwrite(err)) {
		return nil, err
	}
	p := h.Provider()
	if err := blockdev.Format(p, o.Layout); err != nil {
		return nil, fmt.Errorf("prepare %s: %w", h.Path(), err)
	}
	mk, err := keys.Create(p, o.Layout, o.Credentials, o.KDF)
	if err != nil {
		return nil, fmt.Errorf("init %s: %w", h.Path(), err)
	}
	mk.Wipe()
	h.readHeader()
	if h.hdrErr != nil {
		return nil, fmt.Errorf("read back the new header of %s: %w", h.Path(), h.hdrErr)
	}
	return &Created{Header: h.hdr, Note: note}, nil
}

func isOverwrite(err error) bool {
	var o *OverwriteError
	return errors.As(err, &o)
}

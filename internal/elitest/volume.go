package elitest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// Volume makes dir/v.img, a volume of size bytes in mode with 4096-byte sectors and the
// passphrase "test" under the cheapest KDF, in format version 1, and returns its path,
// layout and master key.
func Volume(t testing.TB, dir string, size int64, mode sector.Mode) (string, layout.Layout, *keys.MasterKey) {
	t.Helper()
	return VolumeVersion(t, dir, size, mode, layout.Version1)
}

// VolumeVersion is Volume in a format version (layout.Version2 for the hash tree).
func VolumeVersion(t testing.TB, dir string, size int64, mode sector.Mode, version uint32) (string, layout.Layout, *keys.MasterKey) {
	t.Helper()
	path := filepath.Join(dir, "v.img")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	p, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	l, err := layout.PlanVersion(version, size, 4096, mode, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := blockdev.Format(p, l); err != nil {
		t.Fatal(err)
	}
	kdf, err := keys.Fixed(1, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	mk, err := keys.Create(p, l, keys.Credentials{Passphrase: []byte("test")}, kdf)
	if err != nil {
		t.Fatal(err)
	}
	return path, l, mk
}

// CopyKey is a copy of mk for something that wipes the key it is given.
func CopyKey(t testing.TB, mk *keys.MasterKey) *keys.MasterKey {
	t.Helper()
	c, err := keys.NewMasterKey(mk.VolumeID(), mk.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

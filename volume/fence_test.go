package volume

import (
	"bytes"
	"errors"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// fencedProvider is a provider that another host took over once fenced is set.
type fencedProvider struct {
	*provider.File
	fenced atomic.Bool
}

var errTaken = errors.New("taken over: " + syscall.EIO.Error())

func (f *fencedProvider) Fenced() error {
	if f.fenced.Load() {
		return errTaken
	}
	return nil
}

// TestVolumeFailsWhenFenced: once its provider is fenced the volume refuses every
// write, zero, trim and flush at once (not acknowledging writes into a batch that can
// never commit), reports failed, and still reads.
func TestVolumeFailsWhenFenced(t *testing.T) {
	t.Parallel()
	path, _, mk := testVolume(t, t.TempDir(), 8<<20, sector.Default)
	defer mk.Wipe()
	pf, err := provider.Open(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer pf.Close()
	p := &fencedProvider{File: pf}
	v, err := Open(p, copyKey(t, mk), Options{})
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{9}, 4096)
	if err := v.WriteAt(data, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(); err != nil {
		t.Fatal(err)
	}
	p.fenced.Store(true)
	for name, do := range map[string]func() error{
		"write": func() error { return v.WriteAt(data, 4096, 0) },
		"write, buffer kept": func() error {
			returned := false
			err := v.WriteKeep(bytes.Clone(data), 4096, 0, func() { returned = true })
			if !returned {
				t.Error("a refused WriteKeep kept its buffer")
			}
			return err
		},
		"zeroes": func() error { return v.WriteZeroes(0, 4096, 0) },
		"trim":   func() error { return v.Trim(0, 4096, 0) },
		"flush":  v.Flush,
	} {
		if err := do(); !errors.Is(err, errTaken) {
			t.Errorf("%s on a fenced volume: %v, want the fence's error", name, err)
		}
	}
	if st := v.Status(); st.State != StateFailed || v.Err() == nil {
		t.Errorf("status of a fenced volume: %+v", st)
	}
	got := make([]byte, 4096)
	if err := v.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
		t.Errorf("read of a fenced volume: %v", err)
	}
	v.Close()
}

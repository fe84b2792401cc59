package main

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

// warnf prints a warning that does not stop the command.
func warnf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "eli: warning: "+format+"\n", args...)
}

// openHeader opens a provider for access (volume.OpenProvider: the locks are the
// Handle's) and reads its header, warning about a damaged or stale copy.
func openHeader(path string, a volume.Access) (*volume.Handle, *keys.Header, error) {
	h, err := openProvider(path, a, nil)
	if err != nil {
		return nil, nil, err
	}
	hdr, err := readHeader(h)
	if err != nil {
		h.Close()
		return nil, nil, err
	}
	return h, hdr, nil
}

// openProvider is volume.OpenProvider with the warnings a remote claim gives on stderr.
func openProvider(path string, a volume.Access, o *volume.ProviderOptions) (*volume.Handle, error) {
	if o == nil {
		o = &volume.ProviderOptions{}
	}
	if o.Notify == nil {
		o.Notify = func(m string) { warnf("%s", m) }
	}
	if o.Remote.Interval == 0 {
		o.Remote.Interval = heartbeatInterval()
	}
	return volume.OpenProvider(path, a, o)
}

// readHeader is the header the Handle read, with a warning about a damaged or stale
// copy.
func readHeader(h *volume.Handle) (*keys.Header, error) {
	hdr, err := readHeaderQuiet(h)
	if err == nil && hdr.Warning != nil {
		warnf("%s: %s", h.Path(), headerWarning(hdr))
	}
	return hdr, err
}

// headerWarning says what is wrong with the header copy not used, and what to do.
func headerWarning(hdr *keys.Header) string {
	return fmt.Sprintf("%v (using the %s copy; the next header update repairs the other, and 'eli backup' saves a copy meanwhile)", hdr.Warning, hdr.Copy)
}

// readHeaderQuiet is readHeader for callers that show the warning themselves (dump).
func readHeaderQuiet(p *volume.Handle) (*keys.Header, error) {
	h, err := p.Header()
	if err != nil {
		if errors.Is(err, keys.ErrCorrupt) {
			return nil, fmt.Errorf("%s: %w; if you have a backup: eli restore BACKUP %s", p.Path(), err, p.Path())
		}
		return nil, fmt.Errorf("%s: %w", p.Path(), err)
	}
	return h, nil
}

// kdfFlags are the Argon2id parameters a command that creates a keyslot takes.
type kdfFlags struct {
	memoryMiB int
	time      int
	threads   int
}

func addKDFFlags(cmd *cobra.Command, k *kdfFlags) {
	cmd.Flags().IntVar(&k.memoryMiB, "kdf-memory", 0,
		"Argon2id memory in MiB (default: 512, at most a quarter of RAM; where one pass at 512 MiB takes over 1.5 s, calibration lowers it towards 256)")
	cmd.Flags().IntVar(&k.time, "kdf-time", 0, "Argon2id passes (default: calibrated to about one second on this machine)")
	cmd.Flags().IntVar(&k.threads, "kdf-threads", 0, "Argon2id threads (default: the number of CPUs, at most 4)")
}

// params turns the flags into KDF parameters: explicit passes are used as given,
// otherwise the passes are calibrated on this machine for about a second.
func (k kdfFlags) params(lim keys.KDFLimits) (keys.KDFParams, error) {
	if err := k.validate(lim); err != nil {
		return keys.KDFParams{}, err
	}
	if k.time == 0 {
		p, err := keys.Calibrate(keys.DefaultKDFTarget, k.memoryMiB, k.threads)
		if err != nil {
			return keys.KDFParams{}, fmt.Errorf("calibrate Argon2id: %w", err)
		}
		return p, nil
	}
	p, err := keys.Fixed(k.time, k.memoryMiB, k.threads)
	if err != nil {
		return keys.KDFParams{}, usageError{err}
	}
	if err := lim.Check(p); err != nil {
		return keys.KDFParams{}, usagef("%v; --kdf-allow-expensive goes beyond it", err)
	}
	return p, nil
}

// validate checks the flags before anything slow or interactive happens: against the
// format's bounds, and against lim, so that a new keyslot is one this machine will open.
func (k kdfFlags) validate(lim keys.KDFLimits) error {
	if k.memoryMiB < 0 || k.time < 0 || k.threads < 0 {
		return usagef("KDF parameters must be positive")
	}
	if maxMiB := keys.MaxKDFMemoryKiB >> 10; k.memoryMiB > maxMiB {
		return usagef("--kdf-memory %d: the format allows at most %d MiB", k.memoryMiB, maxMiB)
	}
	if k.time > keys.MaxKDFTime {
		return usagef("--kdf-time %d: KDF parameters out of range: the format allows 1 to %d passes", k.time, keys.MaxKDFTime)
	}
	if k.threads > 255 {
		return usagef("--kdf-threads %d: the format allows 1 to 255 threads", k.threads)
	}
	if uint64(k.memoryMiB)<<10 > lim.MemoryKiB {
		return usagef("--kdf-memory %d MiB is more than the limit of %d MiB (half of this machine's memory); --kdf-allow-expensive goes beyond it", k.memoryMiB, lim.MemoryKiB>>10)
	}
	if k.threads > lim.Threads {
		return usagef("--kdf-threads %d is more than the limit of %d; --kdf-allow-expensive goes beyond it", k.threads, lim.Threads)
	}
	if k.time > 0 {
		p, err := keys.Fixed(k.time, k.memoryMiB, k.threads)
		if err != nil {
			return usageError{err}
		}
		if err := lim.Check(p); err != nil {
			return usagef("%v; --kdf-allow-expensive goes beyond it", err)
		}
		return nil
	}
	mem := k.memoryMiB
	if mem == 0 {
		mem = 256 // any value the default could be; only the given flags are checked
	}
	if _, err := keys.Fixed(1, mem, k.threads); err != nil {
		return usageError{err}
	}
	return nil
}

// writeFileExcl writes data to a new file of mode 0600; it refuses to overwrite.
func writeFileExcl(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(path)
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// readBounded reads at most limit bytes of a file, failing if it is longer.
func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, limit)
	}
	return b, nil
}

// openReadOnly opens a provider for reading without locking it: dump and backup work on
// an attached volume too (a remote one without claiming it).
func openReadOnly(path string) (*volume.Handle, error) {
	return volume.OpenProvider(path, volume.Inspect, nil)
}

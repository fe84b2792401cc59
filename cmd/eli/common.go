package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"syscall"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

// warnf prints a warning that does not stop the command.
func warnf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "eli: warning: "+format+"\n", args...)
}

// openLocked opens a provider and, unless a is readAccess, takes its exclusive lock and
// the host-wide lock on the ID of the volume it holds, so that no other eli process (an
// attached server, another setkey) changes it under us, whatever path it came by.
//
// A remote PROVIDER (an NBD URI) cannot be flock'ed from here: it is claimed through its
// ownership mark instead (remote.Store.Claim), unless a is readAccess (openRemote).
func openLocked(path string, a access) (store, error) {
	if remote.IsURI(path) {
		return openRemote(path, a)
	}
	readOnly := a == readAccess
	p, err := provider.Open(path, readOnly)
	if err != nil {
		if !readOnly && (errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EROFS)) {
			if q, rerr := provider.Open(path, true); rerr == nil {
				q.Close()
				return nil, fmt.Errorf("%s can be opened for reading only (%w): 'eli attach --readonly' serves it read-only; this command needs to write", path, err)
			}
		}
		return nil, err
	}
	if err := p.Lock(); err != nil {
		p.Close()
		if errors.Is(err, provider.ErrInUse) {
			return nil, fmt.Errorf("%s is in use: it is attached (see 'eli list') or another eli command is working on it", path)
		}
		return nil, err
	}
	if readOnly {
		return p, nil
	}
	if err := lockVolumeID(p); err != nil {
		return nil, err
	}
	return p, nil
}

// heldIDLocks are the host-wide locks on the IDs of the volumes this process writes
// (volume.IDLock), taken by openLocked. They live as long as the process, whose exit lets
// go of them, except in a server, which lets go of them after its provider and before its
// name (releaseIDLocks), so that a volume is free again once 'eli detach' returns.
var heldIDLocks []*volume.IDLock

// releaseIDLocks lets go of every volume ID this process holds.
func releaseIDLocks() {
	for _, l := range heldIDLocks {
		l.Close()
	}
	heldIDLocks = nil
}

// lockVolumeID takes the host-wide lock on the ID of the volume p holds, if it holds
// one: the same volume under another path (a loop device over an image file, a second
// path to a disk) or a copy of it is then refused as the same path is by flock. A
// provider without a readable header holds no volume to protect. On failure it closes p.
func lockVolumeID(p store) error {
	h, err := keys.Read(p)
	if err != nil {
		return nil
	}
	id, err := volume.LockID(h.VolumeID)
	if err != nil {
		p.Close()
		if errors.Is(err, volume.ErrIDLocked) {
			return fmt.Errorf("%s: volume %x: %w, through another path ('eli list' shows servers and their pids): "+
				"a loop device over its image, another path to its disk and a copy of it all hold the same volume",
				p.Path(), h.VolumeID, err)
		}
		return err
	}
	heldIDLocks = append(heldIDLocks, id)
	return nil
}

// openHeader opens and locks a provider and reads its header.
func openHeader(path string, a access) (store, *keys.Header, error) {
	p, err := openLocked(path, a)
	if err != nil {
		return nil, nil, err
	}
	h, err := readHeader(p)
	if err != nil {
		p.Close()
		return nil, nil, err
	}
	return p, h, nil
}

// readHeader reads the provider's header and warns about a damaged or stale copy.
func readHeader(p store) (*keys.Header, error) {
	h, err := readHeaderQuiet(p)
	if err == nil && h.Warning != nil {
		warnf("%s: %v (using the %s copy; the next header update repairs the other)", p.Path(), h.Warning, h.Copy)
	}
	return h, err
}

// readHeaderQuiet is readHeader for callers that show h.Warning themselves (dump).
func readHeaderQuiet(p store) (*keys.Header, error) {
	h, err := keys.Read(p)
	if err != nil {
		// keys' message already points to eli restore where both copies are damaged.
		if errors.Is(err, keys.ErrCorrupt) && !strings.Contains(err.Error(), "eli restore") {
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
func openReadOnly(path string) (store, error) {
	if remote.IsURI(path) {
		return openRemote(path, readAccess)
	}
	return provider.Open(path, true)
}

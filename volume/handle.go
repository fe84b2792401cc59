package volume

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
	"time"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
)

// Access is what the holder of a Handle does with the volume, which decides the locks
// OpenProvider takes.
type Access int

const (
	// Inspect reads without any lock (dump, backup): it may see a volume that another
	// process is changing.
	Inspect Access = iota
	// ReadOnly serves the volume read-only: a shared lock on the provider and on the
	// volume ID, so that readers run together but never beside a writer (a reader
	// would serve what the writer's commits left behind it); a remote volume that
	// another host's server heartbeats is refused.
	ReadOnly
	// ReadWrite writes the volume: the provider exclusively (a block device with
	// O_EXCL), its volume ID exclusively, and a remote volume's ownership mark.
	ReadWrite
	// Takeover is ReadWrite for a remote volume that another instance holds: the mark
	// is taken at once (the other server then fences itself), and the volume ID lock
	// only if no process of this host holds it, since that holder may be the server
	// being taken over.
	Takeover
)

func (a Access) String() string {
	return [...]string{"inspect", "read-only", "read-write", "takeover"}[a]
}

// Store is a provider as a Handle gives it out: a local file or block device
// (*provider.File) or a remote NBD export (*remote.Store). The Handle closes it.
type Store interface {
	provider.Provider
	// Punch makes [off, off+length) read as zeroes, cheaply where the storage can.
	Punch(off, length int64) error
	// Path names the provider in messages: the path given, or the URI without
	// secrets.
	Path() string
}

// ProviderOptions say how OpenProvider opens a provider. The zero value is usable.
type ProviderOptions struct {
	// Expect is the header the caller read and unlocked before asking for the locks
	// (OpenProvider with Inspect), so that the slow work (the KDF, the checks against
	// the witness) holds no lock that another user of the volume waits for. Under the
	// locks the header is read again and must be the same: ErrHeaderChanged otherwise.
	Expect *keys.Header
	// LockWait bounds how long a lock held by a command at work on the volume (not a
	// server that serves it, which is refused at once) is waited for: the holder may
	// finish or fail, and a contender with valid keys then gets the volume. Zero is
	// DefaultLockWait; negative does not wait.
	LockWait time.Duration
	// Notify hears what a remote claim waits for and what it takes over.
	Notify func(string)
	// Remote says how a remote provider is reached (timeouts, heartbeat, log).
	Remote remote.Options
}

// DefaultLockWait is how long a lock held by a command at work is waited for.
const DefaultLockWait = 10 * time.Second

// ReleaseTimeout bounds the release of a remote volume's ownership mark at Close: with
// the storage gone the mark stays held, and the next claim takes it over after its
// wait, as after a crash.
const ReleaseTimeout = 5 * time.Second

// Handle is an opened provider and the locks its access needs, taken in one order:
// first the provider's own lock (flock on a local provider; a remote one, which flock
// cannot reach, is claimed through its ownership mark instead), then the host-wide
// volume ID lock, which every path to the volume shares. Close lets go of them in the
// reverse order.
// It is the only holder of those locks in eli: commands and servers ask for a Handle
// and keep no lock state of their own.
type Handle struct {
	path   string
	access Access
	file   *provider.File // a local provider
	rem    *remote.Store  // a remote one
	id     *idLock        // nil where the provider holds no readable header
	hdr    *keys.Header
	hdrErr error
	closed bool
}

// ErrHeaderChanged: the header read under the locks is not the one the caller unlocked
// (ProviderOptions.Expect); someone changed the volume's keys or layout meanwhile.
var ErrHeaderChanged = errors.New("the volume's header changed while it was being unlocked")

// InUseError: another process holds the provider's own lock (flock).
type InUseError struct {
	Path string
	// Serving is true when the holder serves the volume (its volume ID lock says so),
	// false when it may be a command at work on it.
	Serving bool
}

func (e *InUseError) Error() string { return fmt.Sprintf("%s: %v", e.Path, provider.ErrInUse) }
func (e *InUseError) Unwrap() error { return provider.ErrInUse }

// ReadOnlyError: a writer asked for a provider that can be opened for reading only.
type ReadOnlyError struct {
	Path string
	Err  error
}

func (e *ReadOnlyError) Error() string {
	return fmt.Sprintf("%s can be opened for reading only (%v)", e.Path, e.Err)
}
func (e *ReadOnlyError) Unwrap() error { return e.Err }

// OpenProvider opens the provider path names (a file, a block device or an NBD URI)
// and takes the locks access needs; see Access and Handle.
func OpenProvider(path string, access Access, opts *ProviderOptions) (*Handle, error) {
	if opts == nil {
		opts = &ProviderOptions{}
	}
	h := &Handle{path: path, access: access}
	var err error
	if remote.IsURI(path) {
		err = h.openRemote(opts)
	} else {
		err = h.openLocal(opts)
	}
	if err != nil {
		h.Close()
		return nil, err
	}
	if opts.Expect != nil && access != Inspect {
		if h.hdrErr != nil || !bytes.Equal(h.hdr.Backup(), opts.Expect.Backup()) {
			h.Close()
			return nil, fmt.Errorf("%s: %w: try again", h.Path(), ErrHeaderChanged)
		}
	}
	return h, nil
}

func (h *Handle) openLocal(opts *ProviderOptions) error {
	var err error
	switch h.access {
	case Inspect, ReadOnly:
		h.file, err = provider.Open(h.path, true)
	default:
		h.file, err = provider.OpenExclusive(h.path)
		if err != nil && (errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EROFS)) {
			if q, rerr := provider.Open(h.path, true); rerr == nil {
				q.Close()
				return &ReadOnlyError{Path: h.path, Err: err}
			}
		}
	}
	if err != nil {
		return err
	}
	if h.access == Inspect {
		h.readHeader()
		return nil
	}
	lock := h.file.Lock
	if h.access == ReadOnly {
		lock = h.file.LockShared
	}
	if err := waitLock(opts.LockWait, func() (bool, error) {
		err := lock()
		if !errors.Is(err, provider.ErrInUse) {
			return false, err
		}
		// Busy: a server of the volume (its ID says it serves) is refused at once;
		// a command at work on it is waited for.
		h.readHeader()
		serving := h.hdrErr == nil && bound(servingName(h.hdr.VolumeID))
		return !serving, &InUseError{Path: h.path, Serving: serving}
	}); err != nil {
		return err
	}
	h.readHeader()
	return h.lockID(opts)
}

func (h *Handle) openRemote(opts *ProviderOptions) error {
	var err error
	if h.rem, err = remote.Open(h.path, &opts.Remote); err != nil {
		return err
	}
	h.readHeader()
	switch h.access {
	case Inspect:
		return nil
	case ReadOnly:
		if err := h.rem.Probe(remote.ClaimOptions{Notify: opts.Notify}); err != nil {
			return err
		}
	case ReadWrite, Takeover:
		if err := h.rem.Claim(remote.ClaimOptions{Force: h.access == Takeover, Notify: opts.Notify}); err != nil {
			return err
		}
		h.readHeader() // as the claim found it
	}
	if h.access == Takeover {
		if h.hdrErr == nil {
			// Held by a server of this host, which the claim now fences: go on
			// without, as the mark keeps the two apart.
			h.id, _ = lockVolumeID(h.hdr.VolumeID)
		}
		return nil
	}
	return h.lockID(opts)
}

// lockID takes the volume ID lock that h's access needs, if the provider holds a
// header to take it from (one without holds no volume to protect).
func (h *Handle) lockID(opts *ProviderOptions) error {
	if h.hdrErr != nil {
		return nil
	}
	id := h.hdr.VolumeID
	take := lockVolumeID
	if h.access == ReadOnly {
		take = lockVolumeIDShared
	}
	return waitLock(opts.LockWait, func() (bool, error) {
		l, err := take(id)
		if err == nil {
			h.id = l
			return false, nil
		}
		var held *IDHeldError
		if errors.As(err, &held) {
			return !held.Serving, fmt.Errorf("%s: volume %x: %w", h.Path(), id, err)
		}
		return false, err
	})
}

// waitLock calls try until it succeeds, fails for good, or has been asked to wait
// (again is true) for longer than wait.
func waitLock(wait time.Duration, try func() (again bool, err error)) error {
	if wait == 0 {
		wait = DefaultLockWait
	}
	deadline := time.Now().Add(wait)
	for {
		again, err := try()
		if err == nil || !again || !time.Now().Before(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (h *Handle) readHeader() {
	h.hdr, h.hdrErr = keys.Read(h.Provider())
}

// Provider is the opened provider, for the volume's I/O.
func (h *Handle) Provider() Store {
	if h.rem != nil {
		return h.rem
	}
	return h.file
}

// Path names the provider in messages.
func (h *Handle) Path() string {
	switch {
	case h.rem != nil:
		return h.rem.Path()
	case h.file != nil:
		return h.file.Path()
	}
	return h.path
}

// Access is what the Handle was opened for.
func (h *Handle) Access() Access { return h.access }

// Remote reports whether the provider is an NBD export.
func (h *Handle) Remote() bool { return h.rem != nil }

// Header is the provider's header as read under the Handle's locks (or, for Inspect,
// without), and the error keys.Read gave if there is none to read.
func (h *Handle) Header() (*keys.Header, error) { return h.hdr, h.hdrErr }

// SetDeadline bounds every request to a remote provider, in progress or to come, by t,
// whatever its queue timeout says: for a server that must stop within a bound. It does
// nothing for a local provider, whose I/O the kernel does not let a process bound.
func (h *Handle) SetDeadline(t time.Time) {
	if h.rem != nil {
		h.rem.SetDeadline(t)
	}
}

// Health is the state of a remote provider's connections (zero for a local one).
func (h *Handle) Health() nbdclient.Health {
	if h.rem != nil {
		return h.rem.Health()
	}
	return nbdclient.Health{Connected: true}
}

// MarkServing says, through the volume ID lock, that the holder serves the volume:
// contenders are refused at once instead of waiting for it (ProviderOptions.LockWait).
func (h *Handle) MarkServing() error { return h.id.MarkServing() }

// Close lets go of the locks in the reverse of the order they were taken: the volume
// ID, then the provider's own lock: the flock with the descriptor, or the remote mark
// (released, so that the next claim, here or elsewhere, need not wait; within
// ReleaseTimeout, so Close ends even with the storage gone, and its error then says the
// mark could not be released).
func (h *Handle) Close() error {
	if h.closed {
		return nil
	}
	h.closed = true
	var err error
	h.id.Close()
	if h.rem != nil {
		h.rem.SetDeadline(time.Now().Add(ReleaseTimeout))
		err = h.rem.Close()
	}
	if h.file != nil {
		if cerr := h.file.Close(); err == nil {
			err = cerr
		}
	}
	return err
}

// Inherited is what a Handle hands to a process that carries it on (the background
// server), which AdoptProvider turns back into a Handle. The locks stay held throughout:
// the descriptors are the locks, and the remote mark is heartbeated again by the
// adopter.
type Inherited struct {
	Provider *os.File // a local provider's open, locked descriptor; nil for a remote one
	IDLock   *os.File // the volume ID lock's socket, or nil
	Owner    string   // the remote ownership mark's instance, or ""
}

// Handoff prepares h's locks for another process. A remote mark's heartbeat stops here
// (the adopter starts its own) and the mark stays held; after Handoff, Close lets go of
// this process's descriptors only. The files stay open until Close.
func (h *Handle) Handoff() (Inherited, error) {
	var in Inherited
	if h.file != nil {
		in.Provider = h.file.File()
	}
	if h.id != nil {
		in.IDLock = h.id.File()
	}
	if h.rem != nil && h.rem.Instance() != "" {
		inst, err := h.rem.Handoff()
		if err != nil {
			return Inherited{}, err
		}
		in.Owner = inst
	}
	return in, nil
}

// AdoptProvider carries on the Handle another process opened and handed off: the
// provider's descriptor (reconnecting to a remote one), the volume ID lock for id, and
// the remote mark, whose heartbeat it starts.
func AdoptProvider(path string, access Access, in Inherited, id [16]byte, opts *ProviderOptions) (*Handle, error) {
	if opts == nil {
		opts = &ProviderOptions{}
	}
	h := &Handle{path: path, access: access}
	if in.IDLock != nil {
		h.id = adoptIDLock(in.IDLock, id)
	}
	var err error
	if remote.IsURI(path) {
		if in.Provider != nil {
			in.Provider.Close()
		}
		if h.rem, err = remote.Open(path, &opts.Remote); err == nil && in.Owner != "" {
			err = h.rem.Adopt(in.Owner)
		}
	} else {
		h.file, err = provider.FromFile(in.Provider, path)
		if err != nil {
			in.Provider.Close()
		}
	}
	if err != nil {
		h.Close()
		return nil, err
	}
	h.readHeader()
	return h, nil
}

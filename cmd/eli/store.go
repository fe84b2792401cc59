package main

import (
	"fmt"
	"log/slog"
	"net"
	"os"

	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/volume"

	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
)

// store is a PROVIDER as the commands use it: a local file or block device
// (*provider.File, locked with flock), or a remote NBD export (*remote.Store, claimed
// through its ownership mark).
type store interface {
	provider.Provider
	provider.Puncher
	Path() string
	Close() error
}

// access is what a command does with a PROVIDER, which decides how it is opened.
type access int

const (
	readAccess     access = iota // read only: no flock, no claim of a remote volume
	writeAccess                  // flock a local provider, claim a remote one
	takeoverAccess               // as writeAccess, but take a remote volume over from a live owner (attach --force)
)

// openRemote connects to an export; for writeAccess and takeoverAccess it claims the
// volume's ownership mark (waiting out another instance's heartbeat if there is one),
// which Close releases. With writeAccess it then takes the volume's ID lock as well,
// which refuses a volume that this host writes through a path the mark does not reach:
// the export's file or device attached here as a local provider. A takeover does not:
// it may take the volume over from a server of this host, which the mark then fences.
func openRemote(uri string, a access) (store, error) {
	s, err := remote.Open(uri, nil)
	if err != nil {
		return nil, err
	}
	if a == readAccess {
		return s, nil
	}
	if err := s.Claim(remote.ClaimOptions{Force: a == takeoverAccess, Notify: func(m string) { warnf("%s", m) }}); err != nil {
		s.Close()
		return nil, err
	}
	if a == writeAccess {
		if err := lockVolumeID(s); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// providerName is how a PROVIDER argument is recorded and shown: a remote URI in its
// canonical spelling (never with secrets), else the path as given.
func providerName(path string) (string, error) {
	if remote.IsURI(path) {
		return remote.Canonical(path)
	}
	return path, nil
}

// findArg is what volume.StateDir.Find looks for: a remote URI in the spelling the
// record holds.
func findArg(arg string) string {
	if n, err := providerName(arg); err == nil {
		return n
	}
	return arg
}

func noRemoteSize(path string) error {
	return fmt.Errorf("%s is an NBD export: eli cannot change its size; grow the export on the storage side, then run the command without --size", path)
}

// remoteName is the default volume name of a remote provider: its export name, or the
// host (or socket) it is served from.
func remoteName(uri string) string {
	t, err := nbdclient.ParseURI(uri)
	if err != nil {
		return "remote"
	}
	if t.Export != "" {
		return volume.DefaultName(t.Export)
	}
	if t.Network == "tcp" {
		host, _, _ := net.SplitHostPort(t.Address)
		return volume.DefaultName(host)
	}
	return volume.DefaultName(t.Address)
}

// serverProvider is the background server's provider: the inherited descriptor of a
// local one, or a new connection to a remote one, whose ownership mark attach handed
// over (cfg.Owner) and which the server heartbeats from now on.
func serverProvider(pf *os.File, cfg *volume.Config, log *slog.Logger) (store, error) {
	if !remote.IsURI(cfg.Provider) {
		return provider.FromFile(pf, cfg.Provider)
	}
	pf.Close()
	s, err := remote.Open(cfg.Provider, &remote.Options{Logf: func(format string, args ...any) {
		log.Warn(fmt.Sprintf(format, args...), "provider", cfg.Provider)
	}})
	if err != nil {
		return nil, err
	}
	if cfg.Owner != "" {
		if err := s.Adopt(cfg.Owner); err != nil {
			s.Close()
			return nil, err
		}
	}
	return s, nil
}

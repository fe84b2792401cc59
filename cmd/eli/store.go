package main

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/remote"
)

// providerName is how a PROVIDER argument is recorded and shown: a remote URI in its
// canonical spelling (never with secrets), else the path as given.
func providerName(path string) (string, error) {
	if remote.IsURI(path) {
		return remote.Canonical(path)
	}
	return path, nil
}

// findArg is what daemon.StateDir.Find looks for: a remote URI in the spelling the
// record holds.
func findArg(arg string) string {
	if n, err := providerName(arg); err == nil {
		return n
	}
	return arg
}

// ownerIntervalEnv, for tests only, shortens a remote volume's ownership heartbeat (a
// Go duration, 10ms to remote.MaxInterval), so that tests of takeovers do not wait
// seconds.
const ownerIntervalEnv = "ELI_TEST_OWNER_INTERVAL"

// heartbeatInterval is remote.Options.Interval: the default (0), unless
// ownerIntervalEnv says otherwise.
func heartbeatInterval() time.Duration {
	if v := os.Getenv(ownerIntervalEnv); v != "" {
		if d, err := time.ParseDuration(v); err == nil && d >= 10*time.Millisecond && d <= remote.MaxInterval {
			return d
		}
	}
	return 0
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
		return daemon.DefaultName(t.Export)
	}
	if t.Network == "tcp" {
		host, _, _ := net.SplitHostPort(t.Address)
		return daemon.DefaultName(host)
	}
	return daemon.DefaultName(t.Address)
}

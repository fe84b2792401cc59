package main

import (
	"fmt"
	"net"

	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/volume"
)

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

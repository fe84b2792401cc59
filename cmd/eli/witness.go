package main

import (
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
)

// witnessDirHelp names the default witness directory in help texts.
const witnessDirHelp = "$ELI_WITNESS_DIR, /var/lib/eli/witness for root, $XDG_STATE_HOME/eli/witness otherwise"

// witnessPath is the witness file of volume id: flag if given, else a file named by the
// volume ID in the witness directory. The directory must outlive reboots (unlike the
// state directory in /run): a witness that vanishes protects nothing.
func witnessPath(flag string, id [16]byte) (string, error) {
	if flag != "" {
		return filepath.Abs(flag)
	}
	dir := os.Getenv("ELI_WITNESS_DIR")
	switch {
	case dir != "":
	case os.Geteuid() == 0:
		dir = "/var/lib/eli/witness"
	case os.Getenv("XDG_STATE_HOME") != "":
		dir = filepath.Join(os.Getenv("XDG_STATE_HOME"), "eli", "witness")
	default:
		home, err := os.UserHomeDir()
		if err != nil {
			return "", errors.New("no directory for the volume's witness ($HOME unset): give one with --witness FILE")
		}
		dir = filepath.Join(home, ".local", "state", "eli", "witness")
	}
	return filepath.Abs(filepath.Join(dir, hex.EncodeToString(id[:])))
}

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/keysource"
	"github.com/spf13/cobra"
)

// credFlags are the credential options a command takes, once for the key it unlocks
// with and, for setkey, once more for the key it sets. They name key sources
// (keysource): this file turns them into sources and what the sources give into
// keys.Credentials, for every command alike.
type credFlags struct {
	passphraseFile string
	keyfiles       []string
	noPassphrase   bool
	credentials    []string // --credential NAME: systemd credentials, as keyfiles
	keyCommand     string   // --key-command CMD: its output is a keyfile
	askPassword    bool     // --ask-password: systemd's password agent, not the terminal
	keyTimeout     time.Duration
	tries          int
	// allowExpensive lifts keys.DefaultKDFLimits for the keyslots this command opens
	// and the one it creates (--kdf-allow-expensive).
	allowExpensive bool
	// volume names the volume in the password agent's question (attach sets it).
	volume string
}

// defaultKeyTimeout bounds a key command and the password agent unless --key-timeout.
const defaultKeyTimeout = 90 * time.Second

func addCredFlags(cmd *cobra.Command, cf *credFlags, passShort, keyShort, noPassShort string) {
	f := cmd.Flags()
	f.StringVarP(&cf.passphraseFile, "passphrase-file", passShort, "",
		"read the passphrase from the first line of FILE ('-' for standard input) instead of prompting")
	f.StringArrayVarP(&cf.keyfiles, "keyfile", keyShort, nil,
		"use FILE's contents as a key, with or instead of the passphrase (repeatable; '-' for standard input)")
	f.BoolVarP(&cf.noPassphrase, "no-passphrase", noPassShort, false, "use keyfiles (or credentials, or a key command) only, no passphrase")
	f.StringArrayVar(&cf.credentials, "credential", nil,
		"use the systemd credential NAME ($CREDENTIALS_DIRECTORY/NAME, from LoadCredential= or LoadCredentialEncrypted=) as a keyfile (repeatable)")
	f.StringVar(&cf.keyCommand, "key-command", "",
		"run CMD (split into words, no shell) and use its standard output as a keyfile; its standard error goes to the log")
	f.BoolVar(&cf.askPassword, "ask-password", false,
		"ask for the passphrase through systemd's password agent (systemd-ask-password), as at boot, instead of on the terminal")
	f.DurationVar(&cf.keyTimeout, "key-timeout", defaultKeyTimeout, "how long --key-command and --ask-password may take")
	f.IntVar(&cf.tries, "tries", 1, "passphrases to ask for (terminal or --ask-password) before giving up")
	f.BoolVar(&cf.allowExpensive, "kdf-allow-expensive", false,
		fmt.Sprintf("allow Argon2id costs beyond the limits (memory: half of RAM, at most %d MiB; %d lanes; %d GiB × passes in all)",
			keys.MaxKDFMemoryKiB>>10, keys.LimitKDFThreads, keys.LimitKDFWorkKiB>>20))
}

// credentials are what the user supplied, read into memory. Wipe them when done.
type credentials struct {
	passphrase []byte // nil when none
	keyfiles   [][]byte
}

func (c *credentials) wipe() {
	if c == nil {
		return
	}
	clear(c.passphrase)
	for _, k := range c.keyfiles {
		clear(k)
	}
}

// toKeys converts what the user gave into keys.Credentials (sharing the byte slices; wipe
// the credentials, not the conversion).
func (c *credentials) toKeys() keys.Credentials {
	return keys.Credentials{Passphrase: c.passphrase, Keyfiles: c.keyfiles}
}

// openTerminal is where confirmations and prompts go (kill's question, for one).
var openTerminal = keysource.OpenTerminal

// stdinGuard guards against reading two different things from one stdin.
type stdinGuard = keysource.Stdin

var errEmptyPassphrase = keysource.ErrEmptyPassphrase

// keyCount is how many keyfile-like sources cf names.
func (cf credFlags) keyCount() int {
	n := len(cf.keyfiles) + len(cf.credentials)
	if cf.keyCommand != "" {
		n++
	}
	return n
}

// sources turns the flags into key sources: the keys first, then the passphrase, if
// one is wanted. prompt is the terminal prompt; confirm asks twice (a new key).
func (cf credFlags) sources(stdin *stdinGuard, prompt string, confirm bool) (keysFrom []keysource.Source, pass keysource.Source, err error) {
	for _, p := range cf.keyfiles {
		keysFrom = append(keysFrom, keysource.Keyfile{Path: p, Stdin: stdin})
	}
	for _, name := range cf.credentials {
		keysFrom = append(keysFrom, keysource.Credential{Name: name})
	}
	if cf.keyCommand != "" || cf.askPassword {
		if cf.keyTimeout <= 0 {
			return nil, nil, usagef("--key-timeout must be positive: nothing waits forever")
		}
	}
	if cf.keyCommand != "" {
		argv, err := keysource.SplitCommand(cf.keyCommand)
		if err != nil {
			return nil, nil, usageError{fmt.Errorf("--key-command: %w", err)}
		}
		keysFrom = append(keysFrom, keysource.Command{Argv: argv, Timeout: cf.keyTimeout, Stderr: os.Stderr})
	}
	switch {
	case cf.noPassphrase && cf.passphraseFile != "":
		return nil, nil, usagef("--no-passphrase and a passphrase file exclude each other")
	case cf.noPassphrase && cf.askPassword:
		return nil, nil, usagef("--no-passphrase and --ask-password exclude each other")
	case cf.askPassword && cf.passphraseFile != "":
		return nil, nil, usagef("--ask-password and a passphrase file exclude each other")
	case cf.askPassword && confirm:
		return nil, nil, usagef("--ask-password unlocks; a new passphrase comes from the terminal or a file")
	case cf.noPassphrase:
		if len(keysFrom) == 0 {
			return nil, nil, usagef("--no-passphrase needs at least one --keyfile, --credential or --key-command")
		}
	case cf.passphraseFile != "":
		pass = keysource.PassphraseFile{Path: cf.passphraseFile, Stdin: stdin}
	case cf.askPassword:
		id, what := "eli", "the eli volume"
		if cf.volume != "" {
			id, what = "eli:"+cf.volume, "eli volume "+cf.volume
		}
		pass = keysource.AskPassword{ID: id, Message: "Passphrase for " + what + ":", Timeout: cf.keyTimeout}
	default:
		pass = keysource.Prompt{Message: prompt, Confirm: confirm, AllowEmpty: len(keysFrom) > 0}
	}
	return keysFrom, pass, nil
}

// read loads the credentials cf names. prompt is the terminal prompt used when no
// passphrase file is given and a passphrase is wanted; confirm asks twice (for a new key).
func (cf credFlags) read(stdin *stdinGuard, prompt string, confirm bool) (*credentials, error) {
	keysFrom, pass, err := cf.sources(stdin, prompt, confirm)
	if err != nil {
		return nil, err
	}
	c := &credentials{}
	ok := false
	defer func() {
		if !ok {
			c.wipe()
		}
	}()
	ctx := context.Background()
	for _, s := range keysFrom {
		data, err := s.Read(ctx)
		if err != nil {
			return nil, err
		}
		c.keyfiles = append(c.keyfiles, data)
	}
	if pass != nil {
		if c.passphrase, err = pass.Read(ctx); err != nil {
			return nil, err
		}
		if c.passphrase == nil {
			c.passphrase = []byte{} // asked, and answered with nothing
		}
	}
	if c.passphrase != nil && len(c.passphrase) == 0 && len(c.keyfiles) == 0 {
		return nil, errEmptyPassphrase
	}
	ok = true
	return c, nil
}

// interactive reports whether cf's passphrase comes from a person, who may mistype it
// and be asked again (--tries).
func (cf credFlags) interactive() bool {
	return !cf.noPassphrase && cf.passphraseFile == ""
}

// wantsPassphrase reports whether attach should ask for a passphrase: unless told, it
// asks when some active slot uses one.
func wantsPassphrase(h *keys.Header, cf credFlags) bool {
	if cf.noPassphrase || cf.passphraseFile != "" {
		return false
	}
	for _, s := range h.Slots {
		if s.Active && s.Uses&keys.UsesPassphrase != 0 {
			return true
		}
	}
	return false
}

// unlock reads the credentials cf names and opens a keyslot of h. A mistyped passphrase
// from a person is asked for again, up to --tries times in all.
func unlock(h *keys.Header, cf credFlags, slot int, stdin *stdinGuard) (*keys.MasterKey, int, error) {
	if h.ActiveSlots() == 0 {
		return nil, 0, fmt.Errorf("%w: the volume was killed or its last key deleted; restore a header backup to use it again", keys.ErrNoKeys)
	}
	if !cf.noPassphrase && cf.passphraseFile == "" && !wantsPassphrase(h, cf) {
		cf.noPassphrase, cf.askPassword = true, false // every slot is keyfile-only: do not prompt
	}
	if cf.tries < 0 || cf.tries > 100 {
		return nil, 0, usagef("--tries must be 1 to 100")
	}
	tries := 1
	if cf.interactive() && !slices.Contains(cf.keyfiles, "-") {
		tries = max(cf.tries, 1) // standard input cannot be read twice
	}
	for try := 1; ; try++ {
		mk, n, err := unlockOnce(h, cf, slot, stdin)
		if errors.Is(err, keys.ErrWrongKey) && try < tries {
			warnf("%v; %d more tries", err, tries-try)
			continue
		}
		return mk, n, err
	}
}

func unlockOnce(h *keys.Header, cf credFlags, slot int, stdin *stdinGuard) (*keys.MasterKey, int, error) {
	c, err := cf.read(stdin, "Enter passphrase", false)
	if err != nil {
		return nil, 0, err
	}
	defer c.wipe()
	mk, n, err := h.UnlockWithin(c.toKeys(), slot, cf.kdfLimits())
	if errors.Is(err, keys.ErrKDFLimit) {
		return nil, 0, fmt.Errorf("%w. If you trust this provider's header, --kdf-allow-expensive lifts the limits", err)
	}
	if err != nil {
		return nil, 0, err
	}
	return mk, n, nil
}

// kdfLimits are the Argon2id limits for keyslots this command opens or creates.
func (cf credFlags) kdfLimits() keys.KDFLimits {
	if cf.allowExpensive {
		return keys.NoKDFLimits
	}
	return keys.DefaultKDFLimits()
}

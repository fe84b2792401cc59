package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/reencrypt"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"
)

type reencryptOptions struct {
	creds      credFlags
	cipher     string
	unsafe     bool
	format     int
	sectorSize int
	// Credentials of the other keyslots, by slot: "N=FILE".
	slotPassphraseFiles []string
	slotKeyfiles        []string
	dropOthers          bool
	detach              bool
	maxRate             string
}

func newReencryptCmd(g *globalOptions) *cobra.Command {
	o := &reencryptOptions{}
	cmd := &cobra.Command{
		Use:   "reencrypt NAME|PROVIDER",
		Short: "Move a volume to a new master key (and mode) in place",
		Long: `Reencrypt generates a new random master key and moves every sector of the volume
to it, in place, then drops the old key from the header: afterwards no keyslot and no
header copy on the provider can unlock the old key, and an attached volume's server no
longer holds it in memory.

An attached volume stays in use: reencrypt does the key derivations, hands the new
key to the volume's server, and the server moves the sectors while it serves, resting
while clients are busy. Reencrypt shows the progress until the end (a bar on a
terminal); --detach returns once it has started, and 'eli status' shows it. While it
runs, 'eli reencrypt --max-rate RATE NAME' changes how fast it may go. Stopping
reencrypt (Ctrl-C) stops only the watching: the server goes on. A detach stops the
re-encryption at a checkpoint, and the next attach resumes it by itself. A volume
attached read-only cannot be re-encrypted until it is attached read-write (or
detached). A detached volume is re-encrypted by this process, in the same way.

Every keyslot is re-wrapped around the new key under its own credentials, so each
one's credentials are needed: the unlocking ones (-j, -k, -p, ...) and, for the other
active keyslots, --slot-passphrase-file N=FILE and --slot-keyfile N=FILE (on a
terminal, a keyslot that takes a passphrase only is asked for). --drop-other-slots
empties the keyslots whose credentials are not given instead.

In the default mode every sector moves with one write of its data through the
journal, and a crash or an interrupt at any moment loses nothing: run reencrypt again
and it resumes where it stopped (the header keeps both keys until the end). A
length-preserving mode (aes-xts, ...) rewrites a window of sectors at a time behind a
hotzone of checksums in the header region; it assumes the provider writes a sector
atomically. --cipher changes a length-preserving mode into another one; what changes
the volume's layout (format version, authenticated to length-preserving or back,
sector size) cannot be done in place: make a new volume with eli init and copy.

A header backup made before reencrypt (or during it) holds keys the data is no longer
under: restore refuses it. Old copies of the provider's bytes, and its old images,
stay readable with the old key: see docs/threat-model.md.`,
		Example: `  eli reencrypt disk.img                                # asks for the passphrase
  eli reencrypt --detach -j pass.txt data               # attached as "data": runs in its server
  eli reencrypt -j pass.txt --slot-keyfile 1=key.bin disk.img
  eli reencrypt -j pass.txt --drop-other-slots disk.img
  eli reencrypt -j pass.txt --cipher aes-xts disk.img   # an aes128-xts volume to AES-256`,
		Args: exactArgs("NAME|PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runReencrypt(cmd, g, o, args[0])
		},
	}
	f := cmd.Flags()
	addCredFlags(cmd, &o.creds, "j", "k", "p")
	f.StringVarP(&o.cipher, "cipher", "e", "", "move to this mode (length-preserving volumes only; default: keep the mode)")
	f.BoolVar(&o.unsafe, "unsafe", false, "allow moving to an UNSAFE *-xts ChaCha mode or to none")
	f.IntVar(&o.format, "format", 0, "refused unless it is the volume's format version: a new format needs a new volume")
	f.IntVar(&o.sectorSize, "sector-size", 0, "refused unless it is the volume's sector size: a new sector size needs a new volume")
	f.StringArrayVar(&o.slotPassphraseFiles, "slot-passphrase-file", nil, "N=FILE: keep keyslot N, whose passphrase is FILE's first line (repeatable)")
	f.StringArrayVar(&o.slotKeyfiles, "slot-keyfile", nil, "N=FILE: keep keyslot N, which takes keyfile FILE (repeatable, and more than once for a slot)")
	f.BoolVar(&o.dropOthers, "drop-other-slots", false, "empty the active keyslots whose credentials are not given")
	f.StringVar(&o.maxRate, "max-rate", "", "move at most about this much a second (e.g. 50M; 0 or default: as fast as clients leave room for); given alone for an attached volume being re-encrypted, changes its rate")
	f.BoolVar(&o.detach, "detach", false, "an attached volume: return once its server's re-encryption has started ('eli status' shows its progress)")
	return cmd
}

func runReencrypt(cmd *cobra.Command, g *globalOptions, o *reencryptOptions, path string) error {
	var mode sector.Mode
	if o.cipher != "" {
		var err error
		if mode, err = parseModeFlags(o.cipher, 0, o.unsafe); err != nil {
			return err
		}
	}
	var rate int64
	if o.maxRate != "" {
		var err error
		if rate, err = parseSize(o.maxRate); err != nil || rate < 0 {
			return usagef("--max-rate %q: want a size a second, such as 50M (0: no bound)", o.maxRate)
		}
	}
	others, err := o.slotCredentials()
	if err != nil {
		return err
	}
	defer func() {
		for _, c := range others {
			c.Wipe()
		}
	}()
	if sd, err := daemon.ResolveStateDir(g.stateDir); err == nil {
		if rec, err := sd.Find(findArg(path)); err == nil {
			return reencryptAttached(cmd, sd, rec, o, mode, rate, others, path)
		}
	}
	if o.detach {
		return usagef("--detach: %s is not attached, and a detached volume is re-encrypted by this process", path)
	}
	p, h, err := openHeader(path, volume.ReadWrite) // a second reencrypt, or an attach meanwhile, is refused here
	if err != nil {
		return err
	}
	defer p.Close()
	if err := o.checkLayout(h, path); err != nil {
		return err
	}
	r := h.Reencryption()
	stdin := &stdinGuard{}
	var mk *keys.MasterKey
	opts := reencrypt.Options{Header: keys.ReencryptOptions{Mode: mode, DropOthers: o.dropOthers, Limits: o.creds.kdfLimits()}}
	opts.Sweep.MaxRate = rate
	if r.Active {
		// Resume: the keyslots open the new key already.
		if mk, _, err = unlock(h, o.creds, keys.AnySlot, stdin); err != nil {
			return err
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "resuming the re-encryption of %s from %s to %s at sector %d of %d\n", path, r.PrevMode, h.Mode, r.Cursor, h.Sectors)
	} else {
		var c *credentials
		if mk, c, err = o.unlockForStart(h, mode, others, stdin); err != nil {
			return err
		}
		defer c.wipe()
		opts.Header.Slots = others
	}
	defer mk.Wipe()

	total := int64(h.Sectors) * int64(h.SectorSize)
	bar := newReencryptBar(total)
	opts.Sweep.OnProgress = func(st blockdev.ReencryptStatus) {
		_ = bar.Set64(int64(st.Cursor) * int64(h.SectorSize))
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	start := time.Now()
	res, err := reencrypt.Run(ctx, p.Provider(), mk, opts)
	_ = bar.Finish()
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("re-encryption of %s stopped: run eli reencrypt again to resume it from the last checkpoint (until then, attach serves it with both keys)", path)
		}
		return err
	}
	out := cmd.OutOrStdout()
	fmt.Fprintf(out, "%s re-encrypted: %s to %s, key epoch %d; %d sectors moved in %s; the old key is gone from the header\n",
		path, res.From, res.To, res.Epoch, res.Moved, time.Since(start).Round(time.Millisecond))
	if res.Unreadable > 0 {
		warnf("%d sectors opened under neither key (damaged before the re-encryption): they still read as I/O errors", res.Unreadable)
	}
	return nil
}

// checkLayout refuses --format and --sector-size that are not h's.
func (o *reencryptOptions) checkLayout(h *keys.Header, path string) error {
	switch {
	case o.format != 0 && uint32(o.format) != h.Version:
		return usagef("--format %d: %s is format version %d, and a new format changes where every sector lies; make a new volume with 'eli init --format %d' and copy the data", o.format, path, h.Version, o.format)
	case o.sectorSize != 0 && o.sectorSize != h.SectorSize:
		return usagef("--sector-size %d: %s has %d-byte sectors, and a new sector size changes where every sector lies; make a new volume with 'eli init --sector-size %d' and copy the data", o.sectorSize, path, h.SectorSize, o.sectorSize)
	}
	return nil
}

// unlockForStart checks that h can move to mode in place, unlocks it, and gathers the
// credentials of every keyslot to keep into others (the unlocking ones among them,
// which the caller wipes with c).
func (o *reencryptOptions) unlockForStart(h *keys.Header, mode sector.Mode, others map[int]keys.Credentials, stdin *stdinGuard) (*keys.MasterKey, *credentials, error) {
	if err := reencrypt.Check(h, mode); err != nil {
		if errors.Is(err, keys.ErrModeChange) {
			return nil, nil, usageError{err}
		}
		return nil, nil, err
	}
	mk, used, c, err := unlockKeeping(h, o.creds, stdin)
	if err != nil {
		return nil, nil, err
	}
	others[used].Wipe() // the unlocking credentials are the ones that opened it
	others[used] = c.toKeys()
	if err := askOtherSlots(h, others, o.dropOthers); err != nil {
		mk.Wipe()
		c.wipe()
		return nil, nil, err
	}
	return mk, c, nil
}

// unlockKeeping is unlock that keeps the credentials it opened a keyslot with: they
// re-wrap that keyslot.
func unlockKeeping(h *keys.Header, cf credFlags, stdin *stdinGuard) (*keys.MasterKey, int, *credentials, error) {
	if h.ActiveSlots() == 0 {
		return nil, 0, nil, fmt.Errorf("%w: the volume was killed or its last key deleted", keys.ErrNoKeys)
	}
	if !cf.noPassphrase && cf.passphraseFile == "" && !wantsPassphrase(h, cf) {
		cf.noPassphrase, cf.askPassword = true, false
	}
	tries := 1
	if cf.interactive() {
		tries = max(cf.tries, 1)
	}
	for try := 1; ; try++ {
		c, err := cf.read(stdin, "Enter passphrase", false)
		if err != nil {
			return nil, 0, nil, err
		}
		mk, n, err := h.UnlockWithin(c.toKeys(), keys.AnySlot, cf.kdfLimits())
		if err == nil {
			return mk, n, c, nil
		}
		c.wipe()
		if errors.Is(err, keys.ErrWrongKey) && try < tries {
			warnf("%v; %d more tries", err, tries-try)
			continue
		}
		return nil, 0, nil, err
	}
}

// slotCredentials reads --slot-passphrase-file and --slot-keyfile.
func (o *reencryptOptions) slotCredentials() (map[int]keys.Credentials, error) {
	out := map[int]keys.Credentials{}
	parse := func(flag, v string) (int, string, error) {
		n, file, ok := strings.Cut(v, "=")
		slot, err := strconv.Atoi(n)
		if !ok || err != nil || slot < 0 || slot >= keys.NumSlots || file == "" {
			return 0, "", usagef("--%s %q: want N=FILE with N a keyslot, 0 to %d", flag, v, keys.NumSlots-1)
		}
		return slot, file, nil
	}
	fail := func(err error) (map[int]keys.Credentials, error) {
		for _, c := range out {
			c.Wipe()
		}
		return nil, err
	}
	for _, v := range o.slotPassphraseFiles {
		slot, file, err := parse("slot-passphrase-file", v)
		if err != nil {
			return fail(err)
		}
		if len(out[slot].Passphrase) > 0 {
			return fail(usagef("--slot-passphrase-file names keyslot %d twice", slot))
		}
		c, err := credFlags{passphraseFile: file}.read(&stdinGuard{}, "", false)
		if err != nil {
			return fail(fmt.Errorf("keyslot %d: %w", slot, err))
		}
		kc := out[slot]
		kc.Passphrase = c.passphrase
		out[slot] = kc
	}
	for _, v := range o.slotKeyfiles {
		slot, file, err := parse("slot-keyfile", v)
		if err != nil {
			return fail(err)
		}
		c, err := credFlags{keyfiles: []string{file}, noPassphrase: true}.read(&stdinGuard{}, "", false)
		if err != nil {
			return fail(fmt.Errorf("keyslot %d: %w", slot, err))
		}
		kc := out[slot]
		kc.Keyfiles = append(kc.Keyfiles, c.keyfiles...)
		out[slot] = kc
	}
	return out, nil
}

// askOtherSlots asks on the terminal for the passphrase of each other active keyslot
// that takes one alone and has no credentials yet; without a terminal, or for keyslots
// that take keyfiles, it says what to pass.
func askOtherSlots(h *keys.Header, given map[int]keys.Credentials, drop bool) error {
	var missing []string
	for i, s := range h.Slots {
		if _, ok := given[i]; ok || !s.Active || drop {
			continue
		}
		if s.Uses == keys.UsesPassphrase && term.IsTerminal(int(os.Stdin.Fd())) {
			c, err := credFlags{}.read(&stdinGuard{}, fmt.Sprintf("Passphrase of keyslot %d (to keep it)", i), false)
			if err != nil {
				return fmt.Errorf("keyslot %d: %w", i, err)
			}
			given[i] = c.toKeys()
			continue
		}
		missing = append(missing, fmt.Sprintf("%d (%s)", i, s.Uses))
	}
	if len(missing) == 0 {
		return nil
	}
	sort.Strings(missing)
	return usagef("keyslot %s would not open the new master key: give its credentials (--slot-passphrase-file N=FILE, --slot-keyfile N=FILE), or empty it with --drop-other-slots",
		strings.Join(missing, ", "))
}

// newReencryptBar is the progress bar of a re-encryption of total bytes, with its rate
// and time left, on a terminal only.
func newReencryptBar(total int64) *progressbar.ProgressBar {
	return progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(os.Stderr),
		progressbar.OptionSetVisibility(term.IsTerminal(int(os.Stderr.Fd()))),
		progressbar.OptionSetDescription("re-encrypting"),
		progressbar.OptionShowBytes(true),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionClearOnFinish(),
	)
}

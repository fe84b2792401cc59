package main

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newDumpCmd(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "dump PROVIDER|BACKUP",
		Short: "Print the header's fields (never secrets)",
		Long: `Dump prints every field of the eli header of a provider, or of a header backup
file: format version, layout, volume ID, keyslots and their KDF parameters. For a
format version 2 provider it also prints the generation and hash tree root of the
newest journal slot; without the key these are unverified (a slot that a crash
tore, or that someone forged, looks the same), so they say what the provider
claims, not what attach will accept. It never prints key material and needs no
passphrase.`,
		Example: "  eli dump disk.img\n  eli dump disk.eli-backup",
		Args:    exactArgs("PROVIDER|BACKUP"),
		RunE: func(cmd *cobra.Command, args []string) error {
			h, err := headerOf(args[0])
			if err != nil {
				return err
			}
			fmt.Fprint(cmd.OutOrStdout(), h.Dump())
			if h.Copy != keys.CopyNone && h.Layout.Tree() {
				return dumpFreshness(cmd.OutOrStdout(), args[0], h)
			}
			return nil
		},
	}
}

// headerOf reads the header of a provider, or decodes a backup file (exactly one header
// long and starting with the magic).
func headerOf(path string) (*keys.Header, error) {
	if st, err := os.Stat(path); err == nil && st.Mode().IsRegular() && st.Size() == keys.HeaderSize {
		b, err := readBounded(path, keys.HeaderSize)
		if err != nil {
			return nil, err
		}
		if h, err := keys.Decode(b); err == nil || !errors.Is(err, keys.ErrNotELI) {
			return h, err
		}
	}
	p, err := openReadOnly(path)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	if _, err := p.Header(); errors.Is(err, keys.ErrTooSmall) {
		// Truncated or shrunk: show what the header says, and what is wrong.
		h, derr := keys.ReadDamaged(p.Provider())
		if derr == nil {
			warnf("%s: %v; the data past the end is gone: if the provider was shrunk by mistake, grow it back to at least %d bytes",
				path, h.Warning, h.Layout.MinProviderSize())
			return h, nil
		}
	}
	return readHeaderQuiet(p) // the dump shows the warning
}

type setkeyOptions struct {
	slot     int
	old, new credFlags
	kdf      kdfFlags
}

func newSetkeyCmd(g *globalOptions) *cobra.Command {
	o := &setkeyOptions{}
	cmd := &cobra.Command{
		Use:   "setkey PROVIDER",
		Short: "Add a key, or change the key in a keyslot",
		Long: `Setkey unlocks the volume with an existing passphrase and/or keyfiles, then wraps
the master key under new ones: into the first free keyslot, or into --slot N
(replacing what it held). The data is not re-encrypted: it stays under the same
master key. The volume must not be attached while its header changes.`,
		Example: `  eli setkey disk.img                         # prompts for the old and the new passphrase
  eli setkey --slot 1 --passphrase-file old.txt --new-passphrase-file new.txt disk.img
  eli setkey --new-keyfile key.bin --new-no-passphrase disk.img`,
		Args: exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runSetkey(cmd, o, args[0])
		},
	}
	f := cmd.Flags()
	f.IntVarP(&o.slot, "slot", "n", keys.AnySlot, "keyslot to set (0-7; default: the first free one)")
	addCredFlags(cmd, &o.old, "j", "k", "p")
	// -j, -k and -p mean the credentials a command unlocks or creates with, in every
	// command; the new key's flags have long names only, so that no letter means one
	// thing here and another in init.
	f.StringVar(&o.new.passphraseFile, "new-passphrase-file", "", "read the new passphrase from FILE ('-' for standard input)")
	f.StringArrayVar(&o.new.keyfiles, "new-keyfile", nil, "new keyfile (repeatable)")
	f.BoolVar(&o.new.noPassphrase, "new-no-passphrase", false, "the new key uses keyfiles only")
	addKDFFlags(cmd, &o.kdf)
	return cmd
}

func runSetkey(cmd *cobra.Command, o *setkeyOptions, path string) error {
	if o.slot != keys.AnySlot && (o.slot < 0 || o.slot >= keys.NumSlots) {
		return usagef("--slot must be 0 to %d", keys.NumSlots-1)
	}
	if err := o.kdf.validate(o.old.kdfLimits()); err != nil {
		return err
	}
	p, h, err := openHeader(path, volume.ReadWrite)
	if err != nil {
		return err
	}
	defer p.Close()
	stdin := &stdinGuard{}
	mk, used, err := unlock(h, o.old, keys.AnySlot, stdin)
	if err != nil {
		return err
	}
	defer mk.Wipe()
	c, err := o.new.read(stdin, "Enter new passphrase", true)
	if err != nil {
		return err
	}
	defer c.wipe()
	kdf, err := o.kdf.params(o.old.kdfLimits())
	if err != nil {
		return err
	}
	n, err := keys.SetKey(p.Provider(), mk, o.slot, c.toKeys(), kdf)
	if err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "keyslot %d set (%s, %v); unlocked with keyslot %d\n", n, c.toKeys().Uses(), kdf, used)
	return nil
}

func newDelkeyCmd(g *globalOptions) *cobra.Command {
	var slot int
	var force bool
	cmd := &cobra.Command{
		Use:   "delkey --slot N PROVIDER",
		Short: "Destroy one keyslot",
		Long: `Delkey zeroes keyslot N in both header copies. Like geli delkey it needs no
passphrase. It refuses to delete the last active keyslot (which would make the data
unreachable) unless --force is given.`,
		Example: "  eli delkey --slot 1 disk.img",
		Args:    exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if slot < 0 || slot >= keys.NumSlots {
				if cmd.Flags().Changed("slot") {
					return usagef("--slot %d is out of range: keyslots are 0 to %d", slot, keys.NumSlots-1)
				}
				return usagef("--slot N is required, 0 to %d", keys.NumSlots-1)
			}
			p, _, err := openHeader(args[0], volume.ReadWrite)
			if err != nil {
				return err
			}
			defer p.Close()
			if err := keys.DelKey(p.Provider(), slot, force); err != nil {
				if errors.Is(err, keys.ErrLastSlot) {
					return fmt.Errorf("%w; --force deletes it anyway", err)
				}
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "keyslot %d deleted\n", slot)
			return nil
		},
	}
	cmd.Flags().IntVarP(&slot, "slot", "n", -1, "keyslot to delete (0-7)")
	cmd.Flags().BoolVarP(&force, "force", "f", false, "delete even the last active keyslot")
	return cmd
}

func newKillCmd(g *globalOptions) *cobra.Command {
	var yes bool
	cmd := &cobra.Command{
		Use:   "kill PROVIDER",
		Short: "Destroy every keyslot: the data is gone for good",
		Long: `Kill overwrites every keyslot in both header copies. Without a header backup made
before, nothing can decrypt the volume any more, whatever passphrase or keyfile is
known. It asks for confirmation unless --yes is given.`,
		Example: "  eli kill disk.img\n  eli kill --yes disk.img",
		Args:    exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, h, err := openHeader(args[0], volume.ReadWrite)
			if err != nil {
				return err
			}
			defer p.Close()
			if !yes {
				ok, err := confirm(fmt.Sprintf("Destroy every key of %s (%s, %s)? Its data will be unreadable for good. Type 'yes': ",
					args[0], h.Mode, formatSize(int64(h.Sectors)*int64(h.SectorSize))))
				if err != nil {
					return err
				}
				if !ok {
					return errors.New("not confirmed; nothing changed")
				}
			}
			if err := keys.Kill(p.Provider()); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s killed: every keyslot destroyed\n", args[0])
			return nil
		},
	}
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation")
	return cmd
}

// confirm asks on the terminal; without one it refuses (scripts pass --yes).
func confirm(question string) (bool, error) {
	tty, _, err := openTerminal()
	if err != nil {
		return false, errors.New("no terminal to confirm on: pass --yes")
	}
	defer tty.Close()
	fmt.Fprint(tty, question)
	buf := make([]byte, 64)
	n, _ := tty.Read(buf)
	return strings.TrimSpace(string(buf[:n])) == "yes", nil
}

func newBackupCmd(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "backup PROVIDER FILE",
		Short: "Save the header to a file",
		Long: `Backup writes the provider's current header (4096 bytes) to FILE, which must not
exist. With it, 'eli restore' can bring back a volume whose header copies were both
damaged, or undo 'eli kill'. The backup holds the wrapped keys: whoever has it and a
passphrase that was valid when it was made can decrypt the volume, even after the
passphrase was changed. Keep it as safe as the passphrase.`,
		Example: "  eli backup disk.img disk.eli-backup",
		Args:    exactArgs("PROVIDER", "FILE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := openReadOnly(args[0])
			if err != nil {
				return err
			}
			defer p.Close()
			h, err := readHeader(p)
			if err != nil {
				return err
			}
			if err := writeFileExcl(args[1], h.Backup()); err != nil {
				return err
			}
			if h.Reencryption().Active {
				warnf("%s is being re-encrypted: the backup holds the previous master key as well as the new one (restore refuses it once the re-encryption has ended); make a new one after it", args[0])
			}
			fmt.Fprintf(cmd.OutOrStdout(), "header of %s saved to %s\n", args[0], args[1])
			return nil
		},
	}
}

func newRestoreCmd(g *globalOptions) *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "restore FILE PROVIDER",
		Short: "Write a header backup back onto its provider",
		Long: `Restore checks a header backup and writes it as both header copies of PROVIDER.
It refuses a backup of another volume, or one made when the provider had another
size, unless --force is given.`,
		Example: "  eli restore disk.eli-backup disk.img",
		Args:    exactArgs("FILE", "PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			b, err := readBounded(args[0], keys.HeaderSize)
			if err != nil {
				return err
			}
			if _, err := keys.Decode(b); err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			p, err := openProvider(args[1], volume.ReadWrite, nil)
			if err != nil {
				return err
			}
			defer p.Close()
			if err := keys.Restore(p.Provider(), b, force); err != nil {
				if errors.Is(err, keys.ErrOtherVolume) || errors.Is(err, keys.ErrSizeMismatch) {
					return fmt.Errorf("%w; pass --force to restore it anyway", err)
				}
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "header restored onto %s from %s\n", args[1], args[0])
			return nil
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "restore a backup of another volume or size")
	return cmd
}

// dumpFreshness prints the generation and root of a version 2 provider's newest journal
// slot, read without the key.
func dumpFreshness(w io.Writer, path string, h *keys.Header) error {
	p, err := openReadOnly(path)
	if err != nil {
		return err
	}
	defer p.Close()
	f, ok, err := blockdev.PeekFreshness(p.Provider(), h.Layout)
	if err != nil {
		return err
	}
	if !ok {
		fmt.Fprintf(w, "%-15s %s\n", "generation:", "0 (never written)")
		return nil
	}
	fmt.Fprintf(w, "%-15s %d (unverified: read without the key)\n", "generation:", f.Generation)
	fmt.Fprintf(w, "%-15s %s (unverified)\n", "tree root:", hex.EncodeToString(f.Root[:]))
	return nil
}

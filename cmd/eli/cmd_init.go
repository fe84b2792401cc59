package main

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
	"golang.org/x/term"
)

type initOptions struct {
	cipher     string
	keyLength  int
	sectorSize int
	size       string
	journal    string
	backup     string
	unsafe     bool
	force      bool
	format     int
	creds      credFlags
	kdf        kdfFlags
}

func newInitCmd(g *globalOptions) *cobra.Command {
	o := &initOptions{}
	cmd := &cobra.Command{
		Use:     "init PROVIDER",
		Aliases: []string{"label"},
		Short:   "Create an encrypted volume on a file or block device",
		Long: `Init writes a new eli header (two copies: at the start and at the end of the
provider) with a random master key wrapped in keyslot 0 under the passphrase and/or
keyfiles, and prepares the metadata area. It is instant on any size. In the
default mode, sectors that were never written read as zeroes. The length-preserving
modes (aes-xts, aes128-xts, none, *-xts) leave the data area as it is: a sector
never written reads as the provider's old bytes decrypted, which look random (or,
for none, as the old bytes themselves); write zeroes over the attached device if
that matters.

Everything the provider held before is lost. A provider that holds an eli volume,
or what looks like a damaged one, is refused unless --force is given; a killed
volume (see 'eli kill') is not. So is one that holds something else that init
recognizes (ext2/3/4, XFS, btrfs, FAT, NTFS, ISO 9660, LUKS1/2, LVM2, swap, an MBR or
GPT partition table, FreeBSD geli): init names it and refuses without --force, or on
a terminal asks to type 'yes'. A block device that is mounted or in use (device-
mapper, md, swap) is refused whatever the flags.

Modes (--cipher):
  xchacha20-poly1305  default: a fresh random nonce on every write, every sector
                      authenticated; tampering is an I/O error
  aes-xts             AES-256-XTS (--key-length 128 or --cipher aes128-xts for
                      AES-128-XTS), tweak = sector index; length-preserving, no
                      integrity (docs/format.md says what it is compatible with)
  none                no encryption, for measuring overhead; needs --unsafe
  chacha20-xts chacha12-xts chacha8-xts xchacha20-xts xchacha12-xts xchacha8-xts
                      UNSAFE, for benchmark parity only: the keystream is fixed per
                      sector, so two versions of a sector reveal both; needs --unsafe`,
		Example: `  eli init --size 1G disk.img
  eli init --passphrase-file pass.txt --backup disk.eli-backup /dev/sdb
  eli init --no-passphrase --keyfile key.bin --sector-size 512 disk.img
  eli init --cipher chacha20-xts --unsafe disk.img    # benchmark parity only`,
		Args: exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runInit(cmd, o, args[0])
		},
	}
	f := cmd.Flags()
	f.StringVarP(&o.cipher, "cipher", "e", sector.Default.String(), "cipher mode (see above)")
	f.IntVarP(&o.keyLength, "key-length", "l", 0, "AES key length in bits for aes-xts: 128 or 256 (default 256)")
	f.IntVarP(&o.sectorSize, "sector-size", "s", 4096, "sector size in bytes: a power of two from 512 to 65536")
	f.StringVar(&o.size, "size", "", "create the provider file, or grow it, to SIZE (e.g. 1G) before init")
	f.StringVar(&o.journal, "journal-size", "", "journal size for authenticated modes (default 2M; bounds one commit)")
	f.StringVarP(&o.backup, "backup", "B", "", "also write a header backup to FILE (see 'eli restore')")
	f.BoolVar(&o.unsafe, "unsafe", false, "allow the UNSAFE *-xts ChaCha modes (benchmark parity only) and none (no encryption)")
	f.BoolVarP(&o.force, "force", "f", false, "overwrite an existing eli volume, or another format's data")
	f.IntVar(&o.format, "format", 0, "on-disk format version: 2 (hash tree, the default for xchacha20-poly1305) or 1 (no tree; the only one for length-preserving modes)")
	addCredFlags(cmd, &o.creds, "j", "k", "p")
	addKDFFlags(cmd, &o.kdf)
	cmd.RegisterFlagCompletionFunc("cipher", func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		var names []string
		for _, m := range sector.Modes() {
			names = append(names, m.String())
		}
		return names, cobra.ShellCompDirectiveNoFileComp
	})
	return cmd
}

// parseModeFlags resolves --cipher and --key-length.
func parseModeFlags(cipher string, keyLength int, unsafe bool) (sector.Mode, error) {
	mode, err := sector.ParseMode(cipher)
	if err != nil {
		return 0, usageError{err}
	}
	switch keyLength {
	case 0:
	case 128, 256:
		if mode != sector.ModeAESXTS256 && mode != sector.ModeAESXTS128 {
			return 0, usagef("--key-length applies to aes-xts only")
		}
		mode = sector.ModeAESXTS256
		if keyLength == 128 {
			mode = sector.ModeAESXTS128
		}
	default:
		return 0, usagef("--key-length must be 128 or 256")
	}
	switch {
	case mode == sector.ModeNone && !unsafe:
		return 0, usagef("mode none does NOT encrypt: the provider would hold the plaintext, unauthenticated; "+
			"it exists to measure overhead only. Pass --unsafe if that is really what you want, or use the default %s", sector.Default)
	case mode.Unsafe() && !unsafe:
		return 0, usagef("%s is UNSAFE: its keystream is fixed per sector, so anyone who sees two versions of a sector "+
			"(or writes known data and reads the provider) can decrypt it; it exists for benchmark parity only. "+
			"Pass --unsafe if that is really what you want, or use the default %s", mode, sector.Default)
	}
	return mode, nil
}

// modeWarning is what every command that creates or attaches a volume of mode m warns,
// or "" for the modes that protect the data.
func modeWarning(m sector.Mode) string {
	switch {
	case m == sector.ModeNone:
		return "mode none does NOT encrypt: the provider holds the plaintext, unauthenticated. Use it to measure overhead only."
	case m.Unsafe():
		return fmt.Sprintf("%s is UNSAFE: its keystream is fixed per sector, so two versions of a sector "+
			"(or one known plaintext) reveal its contents. Use it for benchmarks only.", m)
	}
	return ""
}

func runInit(cmd *cobra.Command, o *initOptions, path string) (retErr error) {
	mode, err := parseModeFlags(o.cipher, o.keyLength, o.unsafe)
	if err != nil {
		return err
	}
	if !sector.ValidSectorSize(o.sectorSize) {
		return usagef("--sector-size %d: need a power of two from %d to %d", o.sectorSize, sector.MinSectorSize, sector.MaxSectorSize)
	}
	var journal int64
	if o.journal != "" {
		if journal, err = parseSize(o.journal); err != nil {
			return usageError{err}
		}
	}
	version := layout.DefaultVersion(mode)
	switch {
	case o.format == 2 && !mode.Authenticated():
		return usageError{fmt.Errorf("--format 2 is for authenticated modes; %s is length-preserving", mode)}
	case o.format == 1 || o.format == 2:
		version = uint32(o.format)
	case o.format != 0:
		return usageError{fmt.Errorf("--format %d: the format versions are 1 and 2", o.format)}
	}
	if err := o.kdf.validate(o.creds.kdfLimits()); err != nil {
		return err
	}
	if o.backup != "" {
		if _, err := os.Stat(o.backup); err == nil {
			return fmt.Errorf("backup file %s exists: refusing to overwrite it", o.backup)
		}
	}
	var remoteSize int64
	if o.size != "" && remote.IsURI(path) {
		if remoteSize, err = parseSize(o.size); err != nil {
			return usageError{err}
		}
	} else if o.size != "" {
		size, err := parseSize(o.size)
		if err != nil {
			return usageError{err}
		}
		created, err := createOrGrow(path, size)
		if err != nil {
			return err
		}
		if created {
			// A failed init leaves nothing behind: not even the file it made.
			defer func() {
				if retErr != nil {
					os.Remove(path)
				}
			}()
		}
	}
	h, err := openProvider(path, volume.ReadWrite, nil)
	if errors.Is(err, fs.ErrNotExist) && !remote.IsURI(path) && o.size == "" {
		return fmt.Errorf("%s does not exist; give --size to create it", path)
	}
	if err != nil {
		return err
	}
	defer h.Close()
	p := h.Provider()
	if remoteSize > 0 && remoteSize != p.Size() {
		if remoteSize > p.Size() {
			return fmt.Errorf("--size %s is larger than the export %s (%d bytes): eli cannot grow an NBD export; grow it on the storage side, or omit --size to use the export's size",
				o.size, p.Path(), p.Size())
		}
		return fmt.Errorf("--size %s is smaller than the export %s (%d bytes): an eli volume uses its whole provider; omit --size",
			o.size, p.Path(), p.Size())
	}
	force := o.force
	if _, err := volume.CheckOverwrite(h); err != nil {
		if force, err = confirmOverwrite(err, force); err != nil {
			return err
		}
	}
	l, err := layout.PlanVersion(version, p.Size(), o.sectorSize, mode, journal)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	creds, err := o.creds.read(&stdinGuard{}, "Enter new passphrase", true)
	if err != nil {
		return err
	}
	defer creds.wipe()
	kdf, err := o.kdf.params(o.creds.kdfLimits())
	if err != nil {
		return err
	}
	made, err := volume.Create(h, volume.CreateOptions{Layout: l, Credentials: creds.toKeys(), KDF: kdf, Force: force})
	if err != nil {
		return err
	}
	hdr := made.Header
	out := cmd.OutOrStdout()
	if made.Note != "" {
		fmt.Fprintln(out, made.Note)
	}
	fmt.Fprintf(out, "initialized %s: %s, %d-byte sectors, %s usable, format version %d, volume %s\n",
		path, mode, o.sectorSize, formatSize(l.Size()), hdr.Version, hex.EncodeToString(hdr.VolumeID[:]))
	fmt.Fprintf(out, "keyslot 0: %s, %v\n", creds.toKeys().Uses(), kdf)
	if o.backup != "" {
		if err := writeFileExcl(o.backup, hdr.Backup()); err != nil {
			return err
		}
		fmt.Fprintf(out, "header backup written to %s (restore with: eli restore %s %s)\n", o.backup, o.backup, path)
	}
	if w := modeWarning(mode); w != "" {
		warnf("%s", w)
	}
	return nil
}

// confirmOverwrite decides what to do with what volume.CheckOverwrite found: with
// --force, overwrite it; on a terminal, ask for another format's data (a filesystem, a
// partition table), as cryptsetup luksFormat does, and overwrite it if the answer is
// "yes"; otherwise refuse (an eli volume, live or damaged, always needs --force). It
// returns whether Create may overwrite.
func confirmOverwrite(found error, force bool) (bool, error) {
	var over *volume.OverwriteError
	switch {
	case !errors.As(found, &over):
		return false, found // an I/O error: overwrite nothing
	case force:
		return true, nil
	}
	if over.Kind != volume.ForeignData || !term.IsTerminal(int(os.Stdin.Fd())) {
		return false, found
	}
	ok, err := confirm(fmt.Sprintf("%s holds %s: init destroys it. Type 'yes' to overwrite it: ", over.Path, over.What))
	if err != nil {
		return false, found
	}
	if !ok {
		return false, errors.New("not confirmed; nothing changed")
	}
	return true, nil
}

// createOrGrow makes path a regular file of at least size bytes (sparse). created says
// whether it made the file (which a failed init then removes).
func createOrGrow(path string, size int64) (created bool, err error) {
	st, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return false, fmt.Errorf("create %s: %w", path, err)
		}
		f.Close()
		created = true
	case err != nil:
		return false, err
	case !st.Mode().IsRegular():
		return false, usagef("--size applies to regular files; %s is not one", path)
	case st.Size() > size:
		return false, fmt.Errorf("%s is already %d bytes, larger than --size %d: refusing to shrink it", path, st.Size(), size)
	}
	p, err := provider.Open(path, false)
	if err == nil {
		err = p.Extend(size)
		p.Close()
	}
	if err != nil && created {
		os.Remove(path)
	}
	return created, err
}

package main

import (
	"errors"
	"fmt"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newOnetimeCmd(g *globalOptions) *cobra.Command {
	o := &attachOptions{}
	var cipher string
	var keyLength, sectorSize int
	var unsafe, force bool
	cmd := &cobra.Command{
		Use:   "onetime PROVIDER",
		Short: "Attach with a random key and no header (scratch space, swap)",
		Long: `Onetime attaches PROVIDER with a random master key that is never written anywhere:
no header, no keyslots. When it is detached the key is gone and so is the data.
Use it for scratch space and swap. Whatever PROVIDER held is lost; one that holds an
eli volume is refused unless --force is given.`,
		Example: "  eli onetime /dev/sdc\n  eli onetime --sector-size 4096 scratch.img",
		Args:    exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			mode, err := parseModeFlags(cipher, keyLength, unsafe)
			if err != nil {
				return err
			}
			if !sector.ValidSectorSize(sectorSize) {
				return usagef("--sector-size %d: need a power of two from %d to %d", sectorSize, sector.MinSectorSize, sector.MaxSectorSize)
			}
			sd, err := daemon.ResolveStateDir(g.stateDir)
			if err != nil {
				return err
			}
			cfg, err := o.serveSetup(sd, args[0])
			if err != nil {
				return err
			}
			lock, err := lockName(sd, cfg.Name)
			if err != nil {
				return err
			}
			p, err := openProvider(args[0], volume.ReadWrite, &volume.ProviderOptions{Remote: cfg.RemoteOptions(nil)})
			if err != nil {
				lock.Release()
				return err
			}
			if h, err := p.Header(); (err == nil || !errors.Is(err, keys.ErrNotELI)) && !force {
				p.Close()
				lock.Release()
				what := "an eli header"
				if err == nil {
					what = "an eli volume (" + h.Mode.String() + ")"
				}
				return fmt.Errorf("%s holds %s: onetime would destroy it; pass --force to do so", args[0], what)
			}
			mk, err := keys.GenerateMasterKey()
			if err != nil {
				p.Close()
				lock.Release()
				return err
			}
			cfg.Onetime, cfg.Mode, cfg.SectorSize, cfg.VolumeID = true, mode, sectorSize, mk.VolumeID()
			if w := modeWarning(mode); w != "" {
				warnf("%s", w)
			}
			a := &attachment{cfg: cfg, lock: lock, h: p, mk: mk}
			release, err := a.pickDevice(sd)
			if err != nil {
				return err
			}
			defer release()
			return a.serve(cmd, sd, o.foreground)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cipher, "cipher", "e", sector.Default.String(), "cipher mode (see 'eli init --help')")
	f.IntVarP(&keyLength, "key-length", "l", 0, "AES key length in bits for aes-xts: 128 or 256")
	f.IntVarP(&sectorSize, "sector-size", "s", 4096, "sector size in bytes")
	f.BoolVar(&unsafe, "unsafe", false, "allow the UNSAFE *-xts ChaCha modes and none (no encryption)")
	f.BoolVarP(&force, "force", "f", false, "destroy an eli volume on PROVIDER")
	addServeFlags(cmd, o)
	addRemoteFlags(cmd, o)
	return cmd
}

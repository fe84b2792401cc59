package main

import (
	"fmt"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newResizeCmd(g *globalOptions) *cobra.Command {
	var size string
	var creds credFlags
	cmd := &cobra.Command{
		Use:   "resize PROVIDER",
		Short: "Grow a volume to a larger provider",
		Long: `Resize grows the volume to use a larger provider. For a regular file, --size SIZE
grows the file first; for a block device, grow the device itself, then run resize
(without --size it uses the provider's current size). Header copy B moves to the new
end of the provider, in an order that always leaves one good copy. The new sectors
read as zeroes. Shrinking is refused. The volume must not be attached.`,
		Example: "  eli resize --size 2G disk.img\n  eli resize /dev/mapper/vg-lv   # after lvextend",
		Args:    exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := args[0]
			var want int64
			if size != "" {
				var err error
				if want, err = parseSize(size); err != nil {
					return usageError{err}
				}
			}
			hd, h, err := openHeader(path, volume.ReadWrite)
			if err != nil {
				return err
			}
			defer hd.Close()
			p := hd.Provider()
			mk, _, err := unlock(h, creds, keys.AnySlot, &stdinGuard{})
			if err != nil {
				return err
			}
			defer mk.Wipe()
			switch p := p.(type) {
			case *remote.Store:
				if want > 0 {
					return noRemoteSize(path)
				}
				// Follow an export grown on the storage side.
				if _, err := p.Refresh(); err != nil {
					return err
				}
			case *provider.File:
				if want > 0 && want != p.Size() {
					if p.IsBlockDevice() {
						return fmt.Errorf("%s is a block device of %d bytes: grow it first, then run resize without --size", path, p.Size())
					}
					if err := p.Extend(want); err != nil {
						return err
					}
				}
			}
			old := h.Layout
			l, err := layout.PlanVersion(h.Layout.Version, p.Size(), h.SectorSize, h.Mode, h.JournalLen)
			if err != nil {
				return err
			}
			if l.DataOffset != old.DataOffset || l.Sectors < old.Sectors {
				return fmt.Errorf("%s: the new layout does not extend the old one (data offset %d→%d, sectors %d→%d)",
					path, old.DataOffset, l.DataOffset, old.Sectors, l.Sectors)
			}
			if l.Sectors == old.Sectors {
				fmt.Fprintf(cmd.OutOrStdout(), "%s already uses the whole provider (%s)\n", path, formatSize(old.Size()))
				return nil
			}
			// Whatever lies past the old data area (the old header copy B, a grown
			// device's old contents) must read as "never written" in the new one.
			if err := p.Punch(old.End(), layout.DataLimit(p.Size())-old.End()); err != nil {
				return fmt.Errorf("clear the new area: %w", err)
			}
			if err := p.Sync(); err != nil {
				return err
			}
			if err := keys.Resize(p, mk, l.Sectors); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s grown from %s to %s\n", path, formatSize(old.Size()), formatSize(l.Size()))
			return nil
		},
	}
	cmd.Flags().StringVar(&size, "size", "", "grow the provider file to SIZE first (e.g. 2G)")
	addCredFlags(cmd, &creds, "j", "k", "p")
	return cmd
}

package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/elidisk/eli/sector"
	"github.com/spf13/cobra"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print eli's version and the code each mode runs on this machine",
		Args:  exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			v := version
			if bi, ok := debug.ReadBuildInfo(); ok && v == "dev" {
				for _, s := range bi.Settings {
					if s.Key == "vcs.revision" && len(s.Value) >= 12 {
						v = "dev-" + s.Value[:12]
					}
				}
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "eli %s (format versions 1 and 2, %s, %s/%s)\n", v, runtime.Version(), runtime.GOOS, runtime.GOARCH)
			// Which code seals: the bytes are the same everywhere, the speed is not.
			for _, m := range []sector.Mode{sector.ModeXChaCha20Poly1305, sector.ModeAESXTS256, sector.ModeChaCha20XTS} {
				fmt.Fprintf(out, "  %-19s %s\n", m.String()+":", sector.Implementation(m))
			}
			return nil
		},
	}
}

package main

import (
	"encoding/json"
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"
)

func newListCmd(g *globalOptions) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List attached volumes",
		Long: `List the volumes attached on this machine (in this state directory): name,
provider, mode, size, NBD socket and server pid. Records left by servers that were
killed are cleaned up on the way.`,
		Example: "  eli list\n  eli list --json",
		Args:    exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			sd, err := resolveStateDir(g)
			if err != nil {
				return err
			}
			recs, err := sd.live()
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				if recs == nil {
					recs = []*record{}
				}
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(recs)
			}
			if len(recs) == 0 {
				fmt.Fprintln(os.Stderr, "no volumes attached")
				return nil
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tPROVIDER\tMODE\tSIZE\tSOCKET\tPID\tDEVICE")
			for _, r := range recs {
				dev := r.Device
				if dev == "" {
					dev = "-"
				}
				mode := r.Mode
				if r.ReadOnly {
					mode += " (ro)"
				}
				if r.Onetime {
					mode += " (onetime)"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\n", r.Name, r.Provider, mode, formatSize(r.Size), r.Socket, r.Pid, dev)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the records as JSON")
	return cmd
}

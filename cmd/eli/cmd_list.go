package main

import (
	"encoding/json"
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

// listEntry is one line of `eli list`: the server's record and its volume's state.
type listEntry struct {
	*volume.Record
	State string `json:"state"`
	Error string `json:"error,omitempty"`
}

func newListCmd(g *globalOptions) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List attached volumes",
		Long: `List the volumes attached on this machine (in this state directory): name, state,
provider, mode, size, NBD socket and server pid. The state is "serving", or "failed"
once the provider failed a write or flush ('eli status NAME' says what failed): an
authenticated volume then refuses writes until it is detached and attached again.
Records left by servers that were killed are cleaned up on the way.`,
		Example: "  eli list\n  eli list --json",
		Args:    exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			sd, err := volume.ResolveStateDir(g.stateDir)
			if err != nil {
				return err
			}
			recs, err := sd.Live()
			if err != nil {
				return err
			}
			entries := []listEntry{}
			for _, r := range recs {
				e := listEntry{Record: r, State: "unknown"}
				if st, err := sd.ReadStatus(r.Name); err == nil && st.Pid == r.Pid {
					e.State, e.Error = st.State, st.Error
				}
				entries = append(entries, e)
			}
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(entries)
			}
			if len(entries) == 0 {
				fmt.Fprintln(os.Stderr, "no volumes attached")
				return nil
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSTATE\tPROVIDER\tMODE\tSIZE\tSOCKET\tPID\tDEVICE")
			for _, r := range entries {
				dev := r.Device
				if dev == "" {
					dev = "-"
				}
				mode := r.Mode
				if r.Format > 1 {
					mode += fmt.Sprintf(" v%d", r.Format)
				}
				if r.ReadOnly {
					mode += " (ro)"
				}
				if r.Onetime {
					mode += " (onetime)"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", r.Name, r.State, r.Provider, mode, formatSize(r.Size), r.Socket, r.Pid, dev)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the records as JSON")
	return cmd
}

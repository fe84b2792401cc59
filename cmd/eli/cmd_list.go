package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

// listEntry is one line of `eli list`: the server's record and its volume's state.
type listEntry struct {
	*daemon.Record
	State   string `json:"state"`
	Error   string `json:"error,omitempty"`
	Storage string `json:"storage,omitempty"`
	Witness string `json:"witness,omitempty"`
	// Reencrypt is the volume's re-encryption, if one is under way or ended in this
	// server.
	Reencrypt *volume.ReencryptStatus `json:"reencrypt,omitempty"`
}

func newListCmd(g *globalOptions) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List attached volumes",
		Long: `List the volumes attached on this machine (in this state directory): name, state,
provider, mode, size, NBD socket and server pid. Every server process that still
runs is listed, whatever it is doing. The state is:

  serving    attached and answering
  degraded   serving, but its witness cannot be written: a rollback of the provider
             would go unnoticed ('eli status NAME' says why)
  failed     the provider failed a write or flush ('eli status NAME' says what): an
             authenticated volume then refuses writes until detached and attached again
  stopping   shutting down (draining, the final commit, letting go)
  starting   the process holds the name but its export is not ready yet
  suspended  'eli suspend': its keys are wiped and requests wait for 'eli resume'
  frozen     the process is stopped (SIGSTOP, a debugger) and answers nothing

A volume being re-encrypted says so after its state, with how far it is ('eli status
NAME' says more).

Records left by servers that were killed are cleaned up on the way.`,
		Example: "  eli list\n  eli list --json",
		Args:    exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			sd, err := daemon.ResolveStateDir(g.stateDir)
			if err != nil {
				return err
			}
			found, err := sd.List()
			if err != nil {
				return err
			}
			entries := []listEntry{}
			for _, f := range found {
				e := listEntry{Record: f.Record, State: f.State}
				if e.Record == nil {
					e.Record = &daemon.Record{Name: f.Name, Pid: f.Pid}
				}
				if f.Status != nil {
					e.Error, e.Storage, e.Witness, e.Reencrypt = f.Status.Error, f.Status.Storage, f.Status.Witness, f.Status.Reencrypt
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
				prov, size, sock := r.Provider, formatSize(r.Size), r.Socket
				if r.Socket == "" { // still starting: nothing is known but the name and pid
					prov, mode, size, sock = "-", "-", "-", "-"
				}
				state := r.State
				if r.Storage != "" {
					state += " (storage: " + firstWords(r.Storage) + ")"
				}
				if re := r.Reencrypt; re != nil && re.State != volume.ReencryptDone {
					state += fmt.Sprintf(" (re-encrypting %.0f%%", re.Percent())
					if re.State != volume.ReencryptRunning {
						state += ", " + re.State
					}
					state += ")"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", r.Name, state, prov, mode, size, sock, r.Pid, dev)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the records as JSON")
	return cmd
}

// firstWords is a status phrase cut short for a table column: up to its first
// parenthesis or semicolon.
func firstWords(s string) string {
	if i := strings.IndexAny(s, "(;:"); i > 0 {
		return strings.TrimSpace(s[:i])
	}
	return s
}

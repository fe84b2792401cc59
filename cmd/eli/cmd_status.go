package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newStatusCmd(g *globalOptions) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status NAME|PROVIDER",
		Short: "Show an attached volume's state and counters",
		Long: `Status shows what the server of an attached volume has done: its state
("serving", or "failed" once the provider failed a write or flush, after which an
authenticated volume refuses writes), requests served (reads, writes, write-zeroes,
trims, flushes), sectors that failed authentication, commits, what the attach found
in the journal, and the last error.

The server rewrites STATE_DIR/NAME.status when these change, at most four times a
second and at once when the volume fails; status reads that file. After a server whose
volume failed has stopped, status shows its final status until the next attach of NAME.
For a remote provider it also says what is wrong with the storage (unreachable since
when and why, a request waiting, the export no longer this volume), and for a format
version 2 volume whether its witness can be written ("degraded" when not).

Exit status: 0 while the volume serves as it should; 1 when it failed, is degraded,
or its server stopped without its final commit (killed, crashed) or with a problem;
the line on stderr says which.`,
		Example: "  eli status disk.img\n  eli status --json disk.img",
		Args:    exactArgs("NAME|PROVIDER"),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
			return attachedNames(g), cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			sd, err := daemon.ResolveStateDir(g.stateDir)
			if err != nil {
				return err
			}
			name := args[0]
			if rec, err := sd.Find(findArg(name)); err == nil {
				name = rec.Name
			} else if daemon.ValidName(name) != nil {
				return err
			}
			st, err := sd.ReadStatus(name)
			if errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("%s is not attached (see 'eli list')", args[0])
			}
			if err != nil {
				return err
			}
			killed := false
			if st.State != volume.StateStopped && !sd.Alive(name) {
				st.State = volume.StateStopped
				st.Final = "not made: the server was killed or crashed"
				killed = true
			} else if ps := processState(sd, name); ps == daemon.StateFrozen {
				st.State = ps
			}
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				if err := enc.Encode(st); err != nil {
					return err
				}
				return statusExit(st, killed)
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			row := func(k, format string, a ...any) { fmt.Fprintf(tw, "%s:\t"+format+"\n", append([]any{k}, a...)...) }
			row("name", "%s (pid %d)", st.Name, st.Pid)
			row("mode", "%s", st.Mode)
			row("state", "%s", st.State)
			if !st.SuspendedSince.IsZero() {
				row("suspended since", "%s (%d requests held)", st.SuspendedSince.Format(time.RFC3339), st.Held)
			}
			if r := st.Reencrypt; r != nil {
				row("re-encryption", "%s", describeReencrypt(r, st.Name))
			}
			if st.Error != "" {
				row("error", "%s", st.Error)
			}
			if st.Final != "" {
				row("final commit", "%s", st.Final)
			}
			if st.Storage != "" {
				row("storage", "%s", st.Storage)
			}
			if st.Witness != "" {
				row("witness", "%s", st.Witness)
			}
			if !st.LastFlush.IsZero() {
				row("last flush", "%s", st.LastFlush.Format(time.RFC3339))
			}
			row("reads", "%d (%s)", st.Reads, formatSize(int64(st.BytesRead)))
			row("writes", "%d (%s)", st.Writes, formatSize(int64(st.BytesWritten)))
			row("write zeroes", "%d", st.WriteZeroes)
			row("trims", "%d", st.Trims)
			row("flushes", "%d", st.Flushes)
			row("auth failures", "%d", st.AuthFailures)
			row("commits", "%d", st.Commits)
			row("journal at attach", "%s (%d sectors recovered)", st.Journal, st.RecoveredSectors)
			if st.LastError != "" {
				row("last error", "%s (%s)", st.LastError, st.LastErrorAt.Format(time.RFC3339))
			} else {
				row("last error", "none")
			}
			row("updated", "%s", st.Updated.Format(time.RFC3339))
			if err := tw.Flush(); err != nil {
				return err
			}
			return statusExit(st, killed)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status as JSON")
	return cmd
}

// statusExit is status's exit: nil while the volume serves as it should, otherwise the
// one line that says what is wrong (exit 1).
func statusExit(st *volume.Status, killed bool) error {
	msg := problem(st)
	switch {
	case msg != "":
	case killed:
		what := "what was flushed is safe"
		if !st.LastFlush.IsZero() {
			what = "what was flushed up to " + st.LastFlush.Format(time.TimeOnly) + " is safe"
		}
		msg = st.Name + ": the server was killed or crashed before its final commit: " + what +
			", writes acknowledged since may be lost, and the next attach rolls the journal forward or back"
	case st.State == daemon.StateFrozen:
		msg = fmt.Sprintf("%s: the server (pid %d) is frozen (stopped by a signal) and answers nothing: 'kill -CONT %d' continues it",
			st.Name, st.Pid, st.Pid)
	case st.State == volume.StateSuspended:
		msg = fmt.Sprintf("%s: suspended since %s: its keys are wiped and %d requests wait; 'eli resume %s' resumes it",
			st.Name, st.SuspendedSince.Format(time.DateTime), st.Held, st.Name)
	default:
		return nil
	}
	return errors.New(msg)
}

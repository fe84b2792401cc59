package main

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newDetachCmd(g *globalOptions) *cobra.Command {
	var force, keepDevice bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:     "detach NAME|PROVIDER",
		Aliases: []string{"stop"},
		Short:   "Flush, close and forget the keys of an attached volume",
		Long: `Detach stops the server of an attached volume: it finishes the requests in flight,
commits and flushes every write, closes the provider and wipes the keys from memory.
A kernel NBD device connected with 'attach --device' is disconnected as the server
stops; while the device is in use (mounted, stacked on, or open in any process) detach
is refused unless --force.

Detach reports the server's final status: if the provider refused the final commit or
flush (for example, it ran out of space), or failed earlier, detach exits 1 with one
line that says what failed and what state the data is in. The server's log
(STATE_DIR/NAME.log) and status (STATE_DIR/NAME.status, see 'eli status') are then kept
until the next attach of NAME.

--keep-device stops the server (every write committed and flushed) but leaves the
kernel device connected, mounted or not: the kernel holds its I/O until
'eli attach --device DEVICE PROVIDER' plugs a new server in, for up to 60 seconds.
This restarts eli (an upgrade, say) without unmounting.

The server's shutdown is bounded: its final commit and, for a remote provider, every
request to the storage end within --timeout (less 10 s for it to let go), whatever
the storage does. If the storage did not take the final commit, detach exits 1 and
says so: what was flushed up to the last completed flush is safe, later writes may be
lost, and the next attach rolls the journal forward or back. A local disk's I/O cannot
be cut short: a server stuck on a disk that stopped answering is reported, not waited
for without end.

A suspended volume ('eli suspend') is refused, as geli refuses one, since the
requests it holds wait for its keys: 'eli resume' it first. With --force its server
stops at once and fails the requests it holds; they were never acknowledged, and
every write acknowledged before the suspend is on the provider.

--force detaches a device in use (the filesystem on it then fails), and kills a
server that does not exit within --timeout, or that is frozen (stopped by SIGSTOP or a
debugger), with SIGKILL; the name is free again when detach returns. Writes it had acknowledged but
not yet flushed may be lost, exactly as after a power cut (detach then exits 1);
what was flushed is safe, and the next attach repairs the last commit.`,
		Example: "  eli detach disk.img\n  eli detach /srv/disk.img\n  eli detach --force disk.img\n" +
			"  eli detach --keep-device disk.img && eli attach --device /dev/nbd0 disk.img",
		Args: exactArgs("NAME|PROVIDER"),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
			return attachedNames(g), cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			sd, err := daemon.ResolveStateDir(g.stateDir)
			if err != nil {
				return err
			}
			rec, err := sd.Find(findArg(args[0]))
			if err != nil {
				return err
			}
			if keepDevice {
				return detachKeepDevice(sd, rec, timeout)
			}
			return detach(sd, rec, force, timeout)
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "kill a server that does not exit (unflushed writes may be lost)")
	cmd.Flags().BoolVar(&keepDevice, "keep-device", false, "stop the server but leave the kernel device connected, for a new attach to take over")
	cmd.Flags().DurationVar(&timeout, "timeout", time.Minute, "how long to wait for the server to finish")
	return cmd
}

func attachedNames(g *globalOptions) []string {
	sd, err := daemon.ResolveStateDir(g.stateDir)
	if err != nil {
		return nil
	}
	recs, _ := sd.Live()
	var names []string
	for _, r := range recs {
		names = append(names, r.Name)
	}
	return names
}

// stopMargin is what detach leaves the server, out of its --timeout, to let go of the
// provider (a remote mark's release: volume.ReleaseTimeout) and its name after the
// shutdown's deadline.
const stopMargin = 10 * time.Second

// detach stops the server of rec and reports its final status. The server disconnects
// the kernel device itself, as the first step of its shutdown.
func detach(sd daemon.StateDir, rec *daemon.Record, force bool, timeout time.Duration) error {
	state := processState(sd, rec.Name)
	if state == volume.StateSuspended {
		// As geli: a suspended volume holds requests that only a resume can serve.
		held := ""
		if st, err := sd.ReadStatus(rec.Name); err == nil && st.Held > 0 {
			held = fmt.Sprintf(" (%d now)", st.Held)
		}
		if !force {
			return fmt.Errorf("%s is suspended: 'eli resume %s' first, or 'eli detach --force %s' fails the requests it holds%s; "+
				"every write acknowledged before the suspend is on the provider", rec.Name, rec.Name, rec.Name, held)
		}
		if held != "" {
			warnf("%s is suspended: the requests it holds%s fail", rec.Name, held)
		}
	}
	// The server disconnects the kernel device as it stops; refuse before asking it to,
	// while the device is still in use.
	if rec.Device != "" && !force {
		why, err := nbdkernel.InUse(rec.DeviceIdx)
		if err != nil {
			return fmt.Errorf("check whether %s is in use: %w (--force to detach anyway)", rec.Device, err)
		}
		if why != "" {
			return fmt.Errorf("%s is in use: %s; unmount or close it first, or --force to detach anyway (the filesystem on it then fails)", rec.Device, why)
		}
	}
	if rec.Pid == 0 {
		return fmt.Errorf("%s: the process that holds the name cannot be found (see 'eli list')", rec.Name)
	}
	proc, err := os.FindProcess(rec.Pid)
	if err != nil {
		return err
	}
	frozen := state == daemon.StateFrozen
	switch {
	case frozen && !force:
		return fmt.Errorf("server for %s (pid %d) is frozen (stopped by a signal) and answers nothing: 'kill -CONT %d' continues it, 'eli detach --force %s' kills it",
			rec.Name, rec.Pid, rec.Pid, rec.Name)
	case !frozen:
		sd.RequestStop(rec.Name, time.Now().Add(max(timeout-stopMargin, timeout/2)))
		// The lock says the server is alive; its pid is in the record it wrote itself.
		if err := proc.Signal(syscall.SIGTERM); err != nil && sd.Alive(rec.Name) {
			return fmt.Errorf("signal server (pid %d): %w", rec.Pid, err)
		}
		if sd.WaitGone(rec.Name, timeout) {
			waitExit(rec.Pid)
			return finalStatus(sd, rec)
		}
		if !force {
			return fmt.Errorf("server for %s (pid %d) did not exit within %v (%s): its I/O to the provider does not return; "+
				"'eli detach --force %s' kills it (writes since the last completed flush may then be lost)",
				rec.Name, rec.Pid, timeout, processState(sd, rec.Name), rec.Name)
		}
	}
	proc.Signal(syscall.SIGKILL)
	if !sd.WaitGone(rec.Name, 10*time.Second) || !waitExit(rec.Pid) {
		return fmt.Errorf("server for %s (pid %d) survived SIGKILL: it is stuck in the kernel (a disk that does not answer); the name stays taken until it ends", rec.Name, rec.Pid)
	}
	if rec.Device != "" {
		// A killed server did not disconnect: the kernel would hold the device's I/O
		// for a new server until its dead-connection timeout.
		nbdkernel.Disconnect(rec.DeviceIdx)
	}
	st, _ := sd.ReadStatus(rec.Name)
	if l, err := sd.LockName(rec.Name); err == nil {
		sd.Cleanup(rec.Name, rec, false)
		l.Release()
	}
	if st != nil && st.Pid == rec.Pid && st.State == volume.StateStopped {
		return finalStatus(sd, rec) // it had finished; only letting go hung
	}
	flushed := "what was flushed is safe"
	if st != nil && st.Pid == rec.Pid && !st.LastFlush.IsZero() {
		flushed = "what was flushed up to " + st.LastFlush.Format(time.TimeOnly) + " is safe"
	}
	return fmt.Errorf("%s: killed (--force) before its final commit: %s, writes acknowledged since may be lost, "+
		"and the next attach rolls the journal forward or back", rec.Name, flushed)
}

// waitExit waits a moment for process pid to be gone once it has let go of its name
// (the last thing a server does before it exits), so that detach returns with no
// process of the volume left; it reports whether it is.
func waitExit(pid int) bool {
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if !daemon.ProcessRuns(pid) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// processState is what list would say the server of name is doing.
func processState(sd daemon.StateDir, name string) string {
	ents, _ := sd.List()
	for _, e := range ents {
		if e.Name == name {
			return e.State
		}
	}
	return "gone"
}

// detachKeepDevice asks the server to stop without disconnecting its kernel device.
func detachKeepDevice(sd daemon.StateDir, rec *daemon.Record, timeout time.Duration) error {
	if rec.Device == "" {
		return usagef("--keep-device: %s has no kernel device (attach --device)", rec.Name)
	}
	if processState(sd, rec.Name) == volume.StateSuspended {
		return fmt.Errorf("%s is suspended: 'eli resume %s' first", rec.Name, rec.Name)
	}
	if err := syscall.Kill(rec.Pid, syscall.SIGUSR1); err != nil && sd.Alive(rec.Name) {
		return fmt.Errorf("signal server (pid %d): %w", rec.Pid, err)
	}
	if !sd.WaitGone(rec.Name, timeout) {
		return fmt.Errorf("server for %s (pid %d) did not exit within %v", rec.Name, rec.Pid, timeout)
	}
	return finalStatus(sd, rec)
}

// finalStatus reads what the stopped server of rec left: nothing after a clean stop, its
// final status after a failure.
func finalStatus(sd daemon.StateDir, rec *daemon.Record) error {
	st, err := sd.ReadStatus(rec.Name)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: the server stopped, but its final status cannot be read: %w", rec.Name, err)
	}
	if st.Pid != rec.Pid {
		return nil // a later server's: this one left none, so it stopped cleanly
	}
	where := ""
	if rec.Log != "" {
		where = " (log: " + rec.Log + ")"
	}
	if st.State != volume.StateStopped {
		return fmt.Errorf("%s: the server exited without reporting its final commit; what was flushed is safe, "+
			"and the next attach recovers the journal%s", rec.Name, where)
	}
	if msg := problem(st); msg != "" {
		return errors.New(msg + where)
	}
	return nil
}

package main

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newDetachCmd(g *globalOptions) *cobra.Command {
	var force, keepDevice bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "detach NAME|PROVIDER",
		Short: "Flush, close and forget the keys of an attached volume",
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

--force detaches a device in use (the filesystem on it then fails), and kills a
server that no longer answers (SIGKILL): writes it had acknowledged but not yet
flushed may be lost, exactly as after a power cut; what was flushed is safe, and the
next attach repairs the last commit.`,
		Example: "  eli detach disk.img\n  eli detach /srv/disk.img\n  eli detach --force disk.img\n" +
			"  eli detach --keep-device disk.img && eli attach --device /dev/nbd0 disk.img",
		Args: exactArgs("NAME|PROVIDER"),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
			return attachedNames(g), cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			sd, err := volume.ResolveStateDir(g.stateDir)
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
	sd, err := volume.ResolveStateDir(g.stateDir)
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

// detach stops the server of rec and reports its final status. The server disconnects
// the kernel device itself, as the first step of its shutdown.
func detach(sd volume.StateDir, rec *volume.Record, force bool, timeout time.Duration) error {
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
	proc, err := os.FindProcess(rec.Pid)
	if err != nil {
		return err
	}
	// The lock says the server is alive; its pid is in the record it wrote itself.
	if err := proc.Signal(syscall.SIGTERM); err != nil && sd.Alive(rec.Name) {
		return fmt.Errorf("signal server (pid %d): %w", rec.Pid, err)
	}
	if sd.WaitGone(rec.Name, timeout) {
		return finalStatus(sd, rec)
	}
	if !force {
		return fmt.Errorf("server for %s (pid %d) did not exit within %v; 'eli detach --force %s' kills it", rec.Name, rec.Pid, timeout, rec.Name)
	}
	proc.Signal(syscall.SIGKILL)
	if !sd.WaitGone(rec.Name, 10*time.Second) {
		return fmt.Errorf("server for %s (pid %d) survived SIGKILL", rec.Name, rec.Pid)
	}
	if rec.Device != "" {
		// A killed server did not disconnect: the kernel would hold the device's I/O
		// for a new server until its dead-connection timeout.
		nbdkernel.Disconnect(rec.DeviceIdx)
	}
	if l, err := sd.LockName(rec.Name); err == nil {
		sd.Cleanup(rec.Name, rec, false)
		l.Release()
	}
	return nil
}

// detachKeepDevice asks the server to stop without disconnecting its kernel device.
func detachKeepDevice(sd volume.StateDir, rec *volume.Record, timeout time.Duration) error {
	if rec.Device == "" {
		return usagef("--keep-device: %s has no kernel device (attach --device)", rec.Name)
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
func finalStatus(sd volume.StateDir, rec *volume.Record) error {
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
	if msg := st.Problem(); msg != "" {
		return errors.New(msg + where)
	}
	return nil
}

package main

import (
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/elidisk/eli/nbdkernel"
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
			sd, err := resolveStateDir(g)
			if err != nil {
				return err
			}
			rec, err := sd.find(args[0])
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
	sd, err := resolveStateDir(g)
	if err != nil {
		return nil
	}
	recs, _ := sd.live()
	var names []string
	for _, r := range recs {
		names = append(names, r.Name)
	}
	return names
}

func detach(sd stateDir, rec *record, force bool, timeout time.Duration) error {
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
	if err := proc.Signal(syscall.SIGTERM); err != nil && sd.alive(rec.Name) {
		return fmt.Errorf("signal server (pid %d): %w", rec.Pid, err)
	}
	if waitGone(sd, rec.Name, timeout) {
		return nil
	}
	if !force {
		return fmt.Errorf("server for %s (pid %d) did not exit within %v; 'eli detach --force %s' kills it", rec.Name, rec.Pid, timeout, rec.Name)
	}
	proc.Signal(syscall.SIGKILL)
	if !waitGone(sd, rec.Name, 10*time.Second) {
		return fmt.Errorf("server for %s (pid %d) survived SIGKILL", rec.Name, rec.Pid)
	}
	if rec.Device != "" {
		// A killed server did not disconnect: the kernel would hold the device's I/O
		// for a new server until its dead-connection timeout.
		nbdkernel.Disconnect(rec.DeviceIdx)
	}
	if l, err := sd.lockName(rec.Name); err == nil {
		sd.cleanup(rec.Name, rec)
		l.release()
	}
	return nil
}

// detachKeepDevice asks the server to stop without disconnecting its kernel device.
func detachKeepDevice(sd stateDir, rec *record, timeout time.Duration) error {
	if rec.Device == "" {
		return usagef("--keep-device: %s has no kernel device (attach --device)", rec.Name)
	}
	if err := syscall.Kill(rec.Pid, syscall.SIGUSR1); err != nil && sd.alive(rec.Name) {
		return fmt.Errorf("signal server (pid %d): %w", rec.Pid, err)
	}
	if !waitGone(sd, rec.Name, timeout) {
		return fmt.Errorf("server for %s (pid %d) did not exit within %v", rec.Name, rec.Pid, timeout)
	}
	return nil
}

func waitGone(sd stateDir, name string, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for sd.alive(name) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

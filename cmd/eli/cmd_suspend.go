package main

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newSuspendCmd(g *globalOptions) *cobra.Command {
	var all bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "suspend NAME|PROVIDER | --all",
		Short: "Wipe an attached volume's keys from memory and hold its I/O until resume",
		Long: `Suspend takes the keys of an attached volume out of memory while it stays attached
(geli suspend): the server finishes the requests in flight, commits and flushes every
write, pauses a re-encryption, and overwrites every key it holds. Requests that come
afterwards, from NBD clients and from the kernel device, are held, not failed: they
wait until 'eli resume' gives the keys back, and then complete in the order they came.
Nothing needs to be unmounted; a file system on the kernel device just waits.

With a kernel device (attach --device), suspend first raises the device's timeouts
beyond any suspend, and waits until the device has had no request in flight, so that
the kernel does not give up on the requests it holds; resume puts them back.

What suspend does not wipe: the plaintext that the kernel's page cache and the
applications hold, and a few copies that Go gives no way to clear
(docs/threat-model.md, "Suspend"). A onetime volume cannot be suspended: its random key
exists only in the server. --all suspends every attached volume but those.

'eli detach' refuses a suspended volume unless --force, which fails the held requests
(every write acknowledged before the suspend is on the provider).`,
		Example: "  eli suspend disk.img\n  eli suspend --all\n  eli resume disk.img",
		Args: func(c *cobra.Command, args []string) error {
			if all != (len(args) == 0) || len(args) > 1 {
				return usagef("suspend takes NAME|PROVIDER, or --all (see '%s --help')", c.CommandPath())
			}
			return nil
		},
		ValidArgsFunction: func(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
			return attachedNames(g), cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			sd, err := daemon.ResolveStateDir(g.stateDir)
			if err != nil {
				return err
			}
			if timeout <= 0 {
				return usagef("--timeout must be positive")
			}
			if !all {
				rec, err := sd.Find(findArg(args[0]))
				if err != nil {
					return err
				}
				return suspend(sd, rec, timeout)
			}
			recs, err := sd.Live()
			if err != nil {
				return err
			}
			var errs []error
			for _, rec := range recs {
				err := suspend(sd, rec, timeout)
				switch {
				case errors.Is(err, &control.Error{Code: daemon.CodeSuspended}):
				case errors.Is(err, errOnetime):
					warnf("%v", err)
				case err != nil:
					errs = append(errs, err)
				}
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().BoolVarP(&all, "all", "a", false, "suspend every attached volume (onetime ones cannot be)")
	cmd.Flags().DurationVar(&timeout, "timeout", time.Minute, "how long the requests in flight may take to finish")
	return cmd
}

// errOnetime: a onetime volume's key cannot be given back, so it is not suspended.
var errOnetime = errors.New("a onetime volume cannot be suspended")

// suspend suspends the server of rec.
func suspend(sd daemon.StateDir, rec *daemon.Record, timeout time.Duration) error {
	if rec.Onetime {
		return fmt.Errorf("%s: %w: its random key exists only in the server, which keeps it (detach it instead)", rec.Name, errOnetime)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	err := control.Call(ctx, sd.ControlSocket(rec.Name), daemon.OpSuspend, nil, nil, nil)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, &control.Error{Code: daemon.CodeSuspended}):
		return fmt.Errorf("%s is suspended already ('eli resume %s' resumes it): %w", rec.Name, rec.Name, err)
	case errors.Is(err, control.ErrNoServer), errors.Is(err, control.ErrUnknownOp):
		return fmt.Errorf("%s: its server (pid %d) does not answer suspend (started by an older eli, or not running): %w", rec.Name, rec.Pid, err)
	case errors.Is(err, control.ErrTimeout):
		return fmt.Errorf("%s: the requests in flight did not finish within --timeout %v, so nothing was suspended; the volume serves on: %w", rec.Name, timeout, err)
	case errors.Is(err, &control.Error{Code: daemon.CodeStopping}):
		return err
	}
	return fmt.Errorf("%s was not suspended and serves on: %w", rec.Name, err)
}

func newResumeCmd(g *globalOptions) *cobra.Command {
	var creds credFlags
	var slot int
	cmd := &cobra.Command{
		Use:   "resume NAME|PROVIDER",
		Short: "Give a suspended volume its keys back and release its held I/O",
		Long: `Resume unlocks a suspended volume again (geli resume): it reads the volume's header
from the provider, derives the master key from the passphrase and keyfiles here, in
this process, and hands only the master key to the server, which checks it against the
header it reads again, derives the volume's keys, and lets the held requests go, in
the order they came.

The key sources are attach's: a prompt (--tries), --passphrase-file, --keyfile,
--no-passphrase, --credential, --key-command, --ask-password. A wrong passphrase
leaves the volume suspended, with every held request still waiting: run resume again.`,
		Example: "  eli resume disk.img\n  eli resume --passphrase-file pass.txt disk.img",
		Args:    exactArgs("NAME|PROVIDER"),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
			return attachedNames(g), cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if slot != keys.AnySlot && (slot < 0 || slot >= keys.NumSlots) {
				return usagef("--slot must be 0 to %d", keys.NumSlots-1)
			}
			sd, err := daemon.ResolveStateDir(g.stateDir)
			if err != nil {
				return err
			}
			rec, err := sd.Find(findArg(args[0]))
			if err != nil {
				return err
			}
			creds.volume = rec.Name
			return resume(sd, rec, creds, slot)
		},
	}
	addCredFlags(cmd, &creds, "j", "k", "p")
	cmd.Flags().IntVarP(&slot, "slot", "n", keys.AnySlot, "try only keyslot N (0-7)")
	return cmd
}

// resumeTimeout bounds the server's part of a resume (reading the header, deriving the
// keys); the KDF runs here before it.
const resumeTimeout = time.Minute

// resume unlocks rec's volume with the credentials and hands the master key to its
// server.
func resume(sd daemon.StateDir, rec *daemon.Record, creds credFlags, slot int) error {
	ctl := sd.ControlSocket(rec.Name)
	// Ask nothing of a volume that is not suspended.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	var st volume.Status
	err := control.Call(ctx, ctl, daemon.OpStatus, nil, nil, &st)
	cancel()
	if err != nil {
		return fmt.Errorf("%s: its server (pid %d) does not answer: %w", rec.Name, rec.Pid, err)
	}
	if st.State != volume.StateSuspended {
		return fmt.Errorf("%s is not suspended (it is %s)", rec.Name, st.State)
	}
	ins, hdr, err := openHeader(rec.Provider, volume.Inspect)
	if err != nil {
		return err
	}
	ins.Close()
	if id := hex.EncodeToString(hdr.VolumeID[:]); id != rec.VolumeID {
		return fmt.Errorf("%s now holds volume %s, not the attached volume %s: the provider was replaced; %s stays suspended",
			rec.Provider, id, rec.VolumeID, rec.Name)
	}
	mk, _, err := unlock(hdr, creds, slot, &stdinGuard{})
	if errors.Is(err, keys.ErrWrongKey) {
		return fmt.Errorf("%w: %s stays suspended, its held requests waiting; run 'eli resume %s' again", err, rec.Name, rec.Name)
	}
	if err != nil {
		return fmt.Errorf("%w (%s stays suspended)", err, rec.Name)
	}
	defer mk.Wipe()
	ctx, cancel = context.WithTimeout(context.Background(), resumeTimeout)
	defer cancel()
	err = control.Call(ctx, ctl, daemon.OpResume, nil, mk.Bytes(), nil)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, &control.Error{Code: daemon.CodeWrongKey}):
		return fmt.Errorf("%s: the key unlocks the header read here but not the server's: the provider's header changed since the suspend; %s stays suspended: %w",
			rec.Provider, rec.Name, err)
	case errors.Is(err, &control.Error{Code: daemon.CodeNotSuspended}):
		return fmt.Errorf("%s is not suspended (resumed meanwhile?)", rec.Name)
	case errors.Is(err, &control.Error{Code: daemon.CodeStopping}):
		return err
	}
	return fmt.Errorf("%s stays suspended: %w", rec.Name, err)
}

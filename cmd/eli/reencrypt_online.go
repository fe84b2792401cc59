package main

import (
	"context"
	"errors"
	"fmt"
	"os/signal"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

// reencryptAttached re-encrypts the volume that rec's server serves: this process
// unlocks the header and derives every kept keyslot's key, the server writes the start
// and runs the sweep; then, unless --detach, it follows the progress to the end.
func reencryptAttached(cmd *cobra.Command, sd daemon.StateDir, rec *daemon.Record, o *reencryptOptions, mode sector.Mode, rate int64,
	others map[int]keys.Credentials, path string) error {
	name := rec.Name
	switch {
	case rec.Socket == "":
		return fmt.Errorf("%s is still being attached: try again once 'eli list' says it serves", name)
	case rec.Onetime:
		return fmt.Errorf("%s is a onetime volume: it has no header and no key to change (detach it and attach it again for a new random key)", name)
	case rec.ReadOnly:
		return fmt.Errorf("%s is attached read-only, so its server cannot write the header: detach it and re-encrypt it detached, or attach it read-write", name)
	}
	sock := sd.ControlSocket(name)
	st, err := liveStatus(sock, name)
	if err != nil {
		return err
	}
	args := daemon.ReencryptArgs{ReencryptOptions: volume.ReencryptOptions{MaxRate: rate}}
	var secret []byte
	if r := st.Reencrypt; r != nil && r.State != volume.ReencryptDone {
		if r.State == volume.ReencryptRunning && o.maxRate != "" {
			args.SetRate = true
			fmt.Fprintf(cmd.ErrOrStderr(), "the re-encryption of %s runs (%.1f%%): setting its rate\n", name, r.Percent())
		} else if r.State != volume.ReencryptStopped {
			return fmt.Errorf("%w on %s (%s, %.1f%%): its server runs it; 'eli status %s' shows its progress",
				keys.ErrReencrypting, name, r.State, r.Percent(), name)
		}
		if o.cipher != "" {
			return usagef("--cipher: the re-encryption of %s from %s to %s is under way: it goes on into %s", name, r.From, r.To, r.To)
		}
		if !args.SetRate {
			args.Resume = true
			fmt.Fprintf(cmd.ErrOrStderr(), "resuming the re-encryption of %s from %s to %s at %.1f%%, in its server\n", name, r.From, r.To, r.Percent())
		}
	} else {
		src := rec.Provider
		if remote.IsURI(path) {
			src = path // the user's URI may carry what the record leaves out (TLS certificates)
		}
		hd, h, err := openHeader(src, volume.Inspect)
		if err != nil {
			return err
		}
		hd.Close()
		if err := o.checkLayout(h, name); err != nil {
			return err
		}
		if h.Reencryption().Active {
			// Under way, and the server does not run it: it cannot tell yet (a status
			// read as the server resumed it), or it failed to open it.
			return fmt.Errorf("%w on %s, and its server does not report it: see 'eli status %s' and the server's log", keys.ErrReencrypting, name, name)
		}
		mk, c, err := o.unlockForStart(h, mode, others, &stdinGuard{})
		if err != nil {
			return err
		}
		pr, err := keys.PrepareReencrypt(h, mk, keys.ReencryptOptions{Mode: mode, Slots: others, DropOthers: o.dropOthers, Limits: o.creds.kdfLimits()})
		mk.Wipe()
		c.wipe()
		if err != nil {
			return err
		}
		defer pr.Wipe()
		args.Header, secret = pr.Header(), pr.Key().Bytes()
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	var started volume.ReencryptStatus
	err = control.Call(ctx, sock, daemon.OpReencrypt, args, secret, &started)
	cancel()
	switch {
	case errors.Is(err, &control.Error{Code: daemon.CodeReencrypting}):
		return fmt.Errorf("%w (%s)", keys.ErrReencrypting, err)
	case errors.Is(err, &control.Error{Code: daemon.CodeHeaderChanged}):
		return fmt.Errorf("%v: run eli reencrypt again", err)
	case err != nil:
		return fmt.Errorf("the server of %s: %w", name, err)
	}
	if o.detach {
		fmt.Fprintf(cmd.OutOrStdout(), "re-encryption %d of %s (%s to %s) runs in its server: 'eli status %s' shows its progress\n",
			started.Epoch, name, started.From, started.To, name)
		return nil
	}
	return followReencrypt(cmd, sock, name, &started)
}

// liveStatus asks name's server for its status.
func liveStatus(sock, name string) (*volume.Status, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var st volume.Status
	if err := control.Call(ctx, sock, daemon.OpStatus, nil, nil, &st); err != nil {
		if errors.Is(err, control.ErrNoServer) {
			return nil, fmt.Errorf("the server of %s does not answer (%v): see 'eli status %s'", name, err, name)
		}
		return nil, fmt.Errorf("the server of %s: %w", name, err)
	}
	return &st, nil
}

// followReencrypt shows the progress of the re-encryption that started as started,
// until it ends: a bar on a terminal, one line at the end.
func followReencrypt(cmd *cobra.Command, sock, name string, started *volume.ReencryptStatus) error {
	ss := int64(max(started.SectorSize, 1))
	bar := newReencryptBar(int64(started.Sectors) * ss)
	defer bar.Finish()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		st, err := liveStatus(sock, name)
		if err != nil {
			return fmt.Errorf("%v; a re-encryption stopped by its server's end resumes at the next attach", err)
		}
		r := st.Reencrypt
		switch {
		case r == nil || r.Epoch != started.Epoch:
			return fmt.Errorf("the server of %s no longer reports re-encryption %d: see 'eli status %s'", name, started.Epoch, name)
		case r.State == volume.ReencryptDone:
			_ = bar.Finish()
			fmt.Fprintf(cmd.OutOrStdout(), "%s re-encrypted: %s to %s, key epoch %d; %d sectors moved in %s; the old key is gone from the header\n",
				name, r.From, r.To, r.Epoch, r.Moved, r.Finished.Sub(r.Started).Round(time.Millisecond))
			if r.Unreadable > 0 {
				warnf("%d sectors opened under neither key (damaged before the re-encryption): they still read as I/O errors", r.Unreadable)
			}
			return nil
		case r.State == volume.ReencryptStopped:
			return fmt.Errorf("the re-encryption of %s stopped at %.1f%%: %s (eli reencrypt %s resumes it)", name, r.Percent(), r.Error, name)
		}
		_ = bar.Set64(int64(r.Cursor) * ss)
		select {
		case <-ctx.Done():
			_ = bar.Finish()
			fmt.Fprintf(cmd.ErrOrStderr(), "no longer watching: the re-encryption of %s goes on in its server ('eli status %s' shows it)\n", name, name)
			return nil
		case <-tick.C:
		}
	}
}

// describeReencrypt is a re-encryption's status in one line.
func describeReencrypt(r *volume.ReencryptStatus, name string) string {
	where := fmt.Sprintf("%.1f%% (sector %d of %d), %s to %s, key epoch %d", r.Percent(), r.Cursor, r.Sectors, r.From, r.To, r.Epoch)
	switch r.State {
	case volume.ReencryptDone:
		return fmt.Sprintf("done at %s (%s to %s, key epoch %d, %d sectors moved): the old key is gone from the header and from the server",
			r.Finished.Format(time.TimeOnly), r.From, r.To, r.Epoch, r.Moved)
	case volume.ReencryptRunning:
		s := "running: " + where
		if r.BytesPerSecond > 0 {
			s += fmt.Sprintf(", %s/s, about %s left", formatSize(int64(r.BytesPerSecond)), r.Remaining.Round(time.Second))
		}
		return s
	case volume.ReencryptPaused:
		return "paused (the volume is suspended): " + where
	case volume.ReencryptWaiting:
		return "under way, not running: " + where + "; the volume is attached read-only, and an attach read-write resumes it"
	case volume.ReencryptStopped:
		msg := "stopped: " + where
		if r.Error != "" {
			msg += ": " + r.Error
		}
		return msg + "; 'eli reencrypt " + name + "' resumes it"
	}
	return r.State + ": " + where
}

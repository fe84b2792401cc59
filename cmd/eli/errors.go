package main

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/volume"
)

// explain turns the library's typed errors into what the user reads: the words and
// the flags that get them further, which only the CLI knows. Other errors pass as they
// are.
func explain(err error) error {
	var (
		inUse    *volume.InUseError
		idHeld   *volume.IDHeldError
		held     *remote.HeldError
		readOnly *volume.ReadOnlyError
		busy     *provider.BusyError
		over     *volume.OverwriteError
		nameHeld *daemon.NameHeldError
		rollback *volume.RollbackError
		witness  *volume.WitnessError
	)
	switch {
	case err == nil:
		return nil
	case errors.As(err, &inUse):
		if inUse.Serving {
			return fmt.Errorf("%s is in use: it is attached (see 'eli list')", inUse.Path)
		}
		return fmt.Errorf("%s is in use: it is attached (see 'eli list') or another eli command is working on it; try again when it is done", inUse.Path)
	case errors.As(err, &idHeld):
		if !idHeld.Serving {
			return fmt.Errorf("%w, which is not serving it but at work on it (a command, or an attach that has not finished): try again when it is done", err)
		}
		return fmt.Errorf("%w, through another path ('eli list' shows servers and their pids): "+
			"a loop device over its image, another path to its disk and a copy of it all hold the same volume", err)
	case errors.As(err, &held):
		return fmt.Errorf("%w: detach it there first; attach --force takes it over (the other server then stops writing)", err)
	case errors.As(err, &readOnly):
		return fmt.Errorf("%w: 'eli attach --readonly' serves it read-only; this command needs to write", err)
	case errors.As(err, &busy):
		if busy.Why == "" {
			return fmt.Errorf("%s is in use (claimed exclusively: mounted in another namespace, swap, or a program): stop what holds it first", busy.Path)
		}
		return fmt.Errorf("%s is in use (%s): unmount it, or stop what holds it, first", busy.Path, busy.Why)
	case errors.As(err, &over):
		switch over.Kind {
		case volume.LiveVolume:
			return fmt.Errorf("%s already holds %s: 'eli kill' it first, or pass --force to overwrite it", over.Path, over.What)
		case volume.DamagedVolume:
			return fmt.Errorf("%s holds %s: if you have a header backup, 'eli restore BACKUP %s' brings it back; --force overwrites it",
				over.Path, over.What, over.Path)
		}
		return fmt.Errorf("%s holds %s: init would destroy it; pass --force to overwrite it (or answer yes on a terminal)", over.Path, over.What)
	case errors.As(err, &nameHeld):
		if nameHeld.Record == nil {
			return fmt.Errorf("%w (an attach that has not finished): try again when it is done, or choose another name with --name", err)
		}
		return fmt.Errorf("%w: choose another name with --name", err)
	case errors.Is(err, syscall.ENOSPC):
		return fmt.Errorf("%w: free space where the provider lives (its filesystem is full), then try again", err)
	case errors.Is(err, blockdev.ErrFreshness):
		return fmt.Errorf("%w: the provider was changed while it was detached (tampering, or an image restored in part); "+
			"restore a backup of the whole provider, or attach the copy you trust", err)
	case errors.As(err, &witness) && witness.Kind == volume.WitnessDamaged:
		return fmt.Errorf("%w: remove it to trust the provider as it is", err)
	case errors.As(err, &witness) && witness.Kind == volume.WitnessForeign:
		return fmt.Errorf("%w: give this volume's with --witness", err)
	case errors.As(err, &rollback):
		if rollback.Fork {
			return fmt.Errorf("%w; attach the copy you trust with --accept-rollback", err)
		}
		return fmt.Errorf("%w; if you restored it on purpose, attach with --accept-rollback", err)
	}
	return err
}

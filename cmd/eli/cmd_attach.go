package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

type attachOptions struct {
	name        string
	socket      string
	listen      string
	tlsCert     string
	tlsKey      string
	tlsClientCA string
	insecureTCP bool
	readOnly    bool
	force       bool
	foreground  bool
	device      string
	connections int
	writeBack   bool
	witness     string
	rollback    bool
	slot        int
	cacheMiB    int
	creds       credFlags
}

func newAttachCmd(g *globalOptions) *cobra.Command {
	o := &attachOptions{}
	cmd := &cobra.Command{
		Use:   "attach PROVIDER",
		Short: "Unlock a volume and serve it as an NBD export",
		Long: `Attach unlocks the provider with a passphrase and/or keyfiles, takes an exclusive
lock on it, and serves the plaintext volume over NBD on a unix socket (mode 0600):
export "" (the default) and NAME.eli. Like geli attach it returns once the export is
ready, leaving a server process behind; the last line it prints is the NBD URI.
'eli detach NAME' stops it.

  --listen HOST:PORT   also serve over TCP; TLS (--tls-cert, --tls-key, and
                       --tls-client-ca to require client certificates) unless
                       --insecure-tcp says otherwise
  --device /dev/nbdN   also connect the kernel's NBD driver (needs the nbd module);
                       writes are committed before they are acknowledged, so that
                       'eli attach --device' again after a server crash re-plugs
                       the mounted device with nothing lost (--write-back: faster,
                       but a crash can lose acknowledged writes)
  --foreground         serve in this process until SIGTERM or SIGINT (systemd,
                       containers); logs go to stderr

A volume is served once per host: a second attach is refused, also through another
path to its bytes (a loop device over the image file, a second path to the disk) and
of a copy of it, which has the same volume ID. Attach a copy once the original is
detached; a copy in format version 2 needs a --witness of its own.

A remote PROVIDER (an NBD URI) cannot be flock'ed from here: attach claims it through
an ownership mark that the server heartbeats. If another host's server holds it, attach
waits three heartbeats (about 6 s) and refuses while that heartbeat moves; --force takes
the volume over, and the other server stops writing.`,
		Example: `  eli attach disk.img
  nbdinfo "$(eli attach --passphrase-file pass.txt disk.img | tail -1)"
  eli attach --device /dev/nbd0 disk.img && mount /dev/nbd0 /mnt
  eli attach --listen 0.0.0.0:10809 --tls-cert srv.pem --tls-key srv.key --tls-client-ca ca.pem disk.img
  eli attach 'nbds://storage:10809/vol1?tls-certificates=/etc/eli/tls'`,
		Args: exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runAttach(cmd, g, o, args[0])
		},
	}
	f := cmd.Flags()
	addCredFlags(cmd, &o.creds, "j", "k", "p")
	addProfileFlags(cmd)
	f.IntVarP(&o.slot, "slot", "n", keys.AnySlot, "try only keyslot N (0-7)")
	f.BoolVarP(&o.readOnly, "readonly", "r", false, "serve read-only")
	f.StringVar(&o.witness, "witness", "", "the file that records how far this volume has come, to refuse an older image of it (default: "+witnessDirHelp+"/VOLUME-ID)")
	f.BoolVar(&o.rollback, "accept-rollback", false, "attach a provider older than its witness knowingly (an image restored on purpose), and reset the witness to it")
	f.BoolVar(&o.force, "force", false, "take a remote volume over from another host's live attach (that server stops writing)")
	addServeFlags(cmd, o)
	return cmd
}

// addServeFlags adds the flags that say how a volume is served (attach and onetime).
func addServeFlags(cmd *cobra.Command, o *attachOptions) {
	f := cmd.Flags()
	f.StringVar(&o.name, "name", "", "name of the attached volume (default: the provider's base name)")
	f.StringVar(&o.socket, "socket", "", "unix socket to serve on (default: STATE_DIR/NAME.sock)")
	f.StringVar(&o.listen, "listen", "", "also serve on TCP HOST:PORT")
	f.StringVar(&o.tlsCert, "tls-cert", "", "TLS server certificate (PEM) for --listen")
	f.StringVar(&o.tlsKey, "tls-key", "", "TLS server key (PEM) for --listen")
	f.StringVar(&o.tlsClientCA, "tls-client-ca", "", "require TLS client certificates signed by this CA (PEM)")
	f.BoolVar(&o.insecureTCP, "insecure-tcp", false, "serve --listen without TLS: anyone who reaches the port can read and write the volume")
	f.BoolVar(&o.foreground, "foreground", false, "serve in this process until SIGTERM/SIGINT")
	f.StringVar(&o.device, "device", "", "also connect /dev/nbdN through the kernel's NBD driver ('auto': a free one)")
	f.IntVar(&o.connections, "connections", 4, "connections the kernel device uses (with --device)")
	f.BoolVar(&o.writeBack, "write-back", false, "with --device: acknowledge writes before their commit (faster; a server crash can then lose acknowledged writes under a flush the kernel re-sends)")
	f.IntVar(&o.cacheMiB, "cache", 64, "metadata cache size in MiB")
}

// serveSetup checks the options shared by attach and onetime and builds the server's
// config.
func (o *attachOptions) serveSetup(sd volume.StateDir, path string) (*volume.Config, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	name := o.name
	if remote.IsURI(path) {
		if abs, err = providerName(path); err != nil {
			return nil, usageError{err}
		}
		if name == "" {
			name = remoteName(path)
		}
	}
	if name == "" {
		name = volume.DefaultName(abs)
	}
	if err := volume.ValidName(name); err != nil {
		return nil, usageError{err}
	}
	if o.listen != "" && o.tlsCert == "" && !o.insecureTCP {
		return nil, usagef("--listen without TLS exposes the volume to anyone who reaches the port: give --tls-cert and --tls-key, or --insecure-tcp")
	}
	if (o.tlsCert == "") != (o.tlsKey == "") {
		return nil, usagef("--tls-cert and --tls-key go together")
	}
	if (o.tlsCert != "" || o.tlsClientCA != "") && o.listen == "" {
		return nil, usagef("TLS options apply to --listen")
	}
	if o.device != "" && o.device != deviceAuto {
		if _, err := nbdkernel.ParseDevice(o.device); err != nil {
			return nil, usageError{err}
		}
	}
	if o.connections < 1 || o.connections > 64 {
		return nil, usagef("--connections must be 1 to 64")
	}
	if o.cacheMiB < 1 || o.cacheMiB > 1<<20 {
		return nil, usagef("--cache must be 1 MiB or more")
	}
	socket := o.socket
	if socket == "" {
		socket = sd.File(name, ".sock")
	}
	if socket, err = filepath.Abs(socket); err != nil {
		return nil, err
	}
	// unix(7): sun_path holds the path and its NUL. nbd.ListenUnix binds a short temporary
	// name and links it into place, so a longer path would be "served" where no client
	// can connect.
	if limit := len(unix.RawSockaddrUnix{}.Path) - 1; len(socket) > limit {
		return nil, fmt.Errorf("socket path %s is too long (%d bytes; unix sockets allow at most %d): choose a shorter --socket or --state-dir",
			socket, len(socket), limit)
	}
	cfg := &volume.Config{
		Name: name, Provider: abs, Socket: socket, Listen: o.listen,
		TLSCert: absOrEmpty(o.tlsCert), TLSKey: absOrEmpty(o.tlsKey), TLSClientCA: absOrEmpty(o.tlsClientCA),
		InsecureTCP: o.insecureTCP, ReadOnly: o.readOnly, Device: o.device, Connections: o.connections,
		CacheBytes: int64(o.cacheMiB) << 20,
		// The kernel device re-plugs after a server crash (attach --device again): only
		// writes committed before they were acknowledged survive that.
		WriteThrough: o.device != "" && !o.writeBack,
	}
	if o.writeBack && o.device == "" {
		return nil, usagef("--write-back goes with --device (other clients get write-back anyway)")
	}
	return cfg, nil
}

func absOrEmpty(p string) string {
	if p == "" {
		return ""
	}
	a, err := filepath.Abs(p)
	if err != nil {
		return p
	}
	return a
}

func runAttach(cmd *cobra.Command, g *globalOptions, o *attachOptions, path string) error {
	sd, err := volume.ResolveStateDir(g.stateDir)
	if err != nil {
		return err
	}
	a, err := prepareAttach(sd, o, path)
	if err != nil {
		return err
	}
	release, err := a.pickDevice(sd)
	if err != nil {
		return err
	}
	defer release()
	return a.serve(cmd, sd, o.foreground)
}

// attachment is a reserved name and an unlocked provider, ready to be served.
type attachment struct {
	cfg  *volume.Config
	lock *volume.NameLock
	p    store
	mk   *keys.MasterKey
}

// lockName reserves cfg's name and clears what an earlier server of that name left.
func lockName(sd volume.StateDir, name string) (*volume.NameLock, error) {
	lock, err := sd.LockName(name)
	if errors.Is(err, volume.ErrNameTaken) {
		return nil, fmt.Errorf("the name %s is already attached (see 'eli list'); choose another with --name", name)
	}
	if err != nil {
		return nil, err
	}
	sd.Cleanup(name, nil, true) // whatever a killed or failed server left behind
	return lock, nil
}

// prepareAttach reserves the name, locks and unlocks the provider.
func prepareAttach(sd volume.StateDir, o *attachOptions, path string) (*attachment, error) {
	if o.slot != keys.AnySlot && (o.slot < 0 || o.slot >= keys.NumSlots) {
		return nil, usagef("--slot must be 0 to %d", keys.NumSlots-1)
	}
	cfg, err := o.serveSetup(sd, path)
	if err != nil {
		return nil, err
	}
	o.creds.volume = cfg.Name // the password agent's question names it
	lock, err := lockName(sd, cfg.Name)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			lock.Release()
		}
	}()
	a := writeAccess
	switch {
	case o.readOnly:
		a = readAccess
	case o.force:
		a = takeoverAccess
	}
	p, h, err := openHeader(path, a)
	if err != nil {
		return nil, err
	}
	defer func() {
		if !ok {
			p.Close()
		}
	}()
	mk, _, err := unlock(h, o.creds, o.slot, &stdinGuard{})
	if err != nil {
		return nil, err
	}
	if w := modeWarning(h.Mode); w != "" {
		warnf("%s: %s", path, w)
	}
	cfg.VolumeID = h.VolumeID
	if h.Layout.Version >= 2 {
		if cfg.Witness, err = witnessPath(o.witness, h.VolumeID); err != nil {
			return nil, err
		}
		cfg.AcceptRollback = o.rollback
	} else if o.witness != "" || o.rollback {
		warnf("%s: a format version 1 volume has no generation to witness; --witness and --accept-rollback do nothing", path)
	}
	ok = true
	return &attachment{cfg: cfg, lock: lock, p: p, mk: mk}, nil
}

// release lets go of the provider, its volume's ID and the name, in that order: once
// the name is free (which is what 'eli detach' waits for), the volume must be free too.
func (a *attachment) release() {
	a.p.Close()
	releaseIDLocks()
	a.lock.Release()
}

// serve serves in this process (--foreground) or starts the background server and waits
// until it reports that the export is ready. Either way the provider and the name are
// free again when it returns, unless a background server holds them.
func (a *attachment) serve(cmd *cobra.Command, sd volume.StateDir, foreground bool) error {
	if foreground {
		defer a.release()
		log := slog.New(slog.NewTextHandler(os.Stderr, nil))
		if err := keys.ForbidCoreDumps(); err != nil {
			log.Warn("core dumps stay possible", "err", err)
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
		defer stop()
		svc := newService(ctx, a.cfg, log)
		defer svc.stopped()
		ready := false
		err := volume.Run(ctx, a.cfg, sd, a.p, a.mk, log, func(rec *volume.Record) {
			ready = true
			printReady(cmd.OutOrStdout(), rec, a.cfg)
			svc.ready(rec)
		})
		if err != nil && ready {
			return finalError(sd, a.cfg.Name, err)
		}
		return err
	}
	if rs, ok := a.p.(*remote.Store); ok && rs.Instance() != "" {
		// The server heartbeats the mark from now on: it adopts this claim.
		inst, err := rs.Handoff()
		if err != nil {
			a.mk.Wipe()
			a.lock.Release()
			return err
		}
		a.cfg.Owner = inst
	}
	rec, err := spawnServer(sd, a.cfg, a.p, a.lock, a.mk)
	a.mk.Wipe()
	a.p.Close()
	releaseIDLocks() // the server holds on to the volume's, if it started
	if err != nil {
		// The child has let go of both locks before it said so; this process holds the
		// name's alone now.
		a.lock.Release()
		return err
	}
	a.lock.Close() // the server holds it on
	printReady(cmd.OutOrStdout(), rec, a.cfg)
	return nil
}

// finalError is the one line that says how a server's final commit failed, from the
// status it left, or err itself if it left none.
func finalError(sd volume.StateDir, name string, err error) error {
	if st, serr := sd.ReadStatus(name); serr == nil && st.Pid == os.Getpid() {
		if msg := st.Problem(); msg != "" {
			return errors.New(msg)
		}
	}
	return fmt.Errorf("%s: %w", name, err)
}

// printReady says where the export is; the last line is its unix URI, for scripts.
func printReady(out io.Writer, rec *volume.Record, cfg *volume.Config) {
	if rec.Listen != "" {
		tls := "no TLS"
		if cfg.TLSCert != "" {
			tls = "TLS"
		}
		fmt.Fprintf(out, "listening on %s (%s)\n", rec.Listen, tls)
	}
	if rec.Device != "" {
		fmt.Fprintf(out, "connected %s\n", rec.Device)
	}
	fmt.Fprintln(out, rec.URI)
}

// The background server inherits, besides stdin/stdout/stderr (all /dev/null or its log):
const (
	fdProvider = 3 // the provider, opened and flock'ed by attach
	fdNameLock = 4 // the state directory's NAME.lock, flock'ed by attach
	fdSetup    = 5 // read end of a pipe: volume.WriteSetup
	fdReady    = 6 // write end of a pipe: volume.WriteReady once ready (or failed)
	fdIDLock   = 7 // the volume's host-wide ID lock (volume.IDLock) taken by attach, or /dev/null
)

// spawnServer re-executes eli as the background server. The master key goes through a
// pipe, never argv or the environment; the provider, the name lock and the volume's ID
// lock are inherited already locked, so no other attach can slip in between.
func spawnServer(sd volume.StateDir, cfg *volume.Config, p store, lock *volume.NameLock, mk *keys.MasterKey) (*volume.Record, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cfg.LogFile = sd.File(cfg.Name, ".log")
	// A new log for each server: the last one's was kept only if it failed, for the user.
	logf, err := os.OpenFile(cfg.LogFile, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open server log: %w", err)
	}
	defer logf.Close()
	setupR, setupW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer setupR.Close()
	defer setupW.Close()
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer readyR.Close()
	defer readyW.Close()

	child := exec.Command(exe, "__serve")
	child.Stdin = nil
	child.Stdout = logf
	child.Stderr = logf
	pf, ok := p.(*provider.File)
	var provFile *os.File
	if ok {
		provFile = pf.File()
	} else {
		// A remote provider is reconnected by the server from cfg.Provider.
		if provFile, err = os.Open(os.DevNull); err != nil {
			return nil, err
		}
		defer provFile.Close()
	}
	var idFile *os.File
	if len(heldIDLocks) == 1 {
		idFile = heldIDLocks[0].File()
	} else {
		// The descriptor must be there, or the server could take whatever the runtime
		// opens first for it; /dev/null is no lock.
		if idFile, err = os.Open(os.DevNull); err != nil {
			return nil, err
		}
		defer idFile.Close()
	}
	child.ExtraFiles = []*os.File{provFile, lock.File(), setupR, readyW, idFile}
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	child.Env = append(os.Environ(), "ELI_STATE_DIR="+sd.Path)
	if err := child.Start(); err != nil {
		return nil, fmt.Errorf("start server: %w", err)
	}
	readyW.Close()
	setupR.Close()

	werr := volume.WriteSetup(setupW, cfg, mk)
	setupW.Close()
	if werr != nil {
		child.Process.Kill()
		child.Wait()
		return nil, fmt.Errorf("hand the key to the server: %w", werr)
	}
	rec, err := volume.ReadReady(readyR)
	if err == nil {
		// The child is the server and outlives us: release it, not wait for it.
		child.Process.Release()
		return rec, nil
	}
	// A child that failed exits at once; waiting for it means that its locks, which it
	// may not have reached the point of closing in order, are gone when attach returns.
	child.Wait()
	if errors.Is(err, volume.ErrNoReady) {
		return nil, fmt.Errorf("%w%s", err, logTail(cfg.LogFile))
	}
	return nil, err
}

// logTail returns the last line of the server's log, for an error message.
func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return ": " + lines[len(lines)-1] + " (log: " + path + ")"
}

// newServeCmd is the background server's entry point (hidden; started by attach/onetime).
func newServeCmd(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:    "__serve",
		Hidden: true,
		Args:   exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runBackgroundServer(g)
		},
	}
}

func runBackgroundServer(g *globalOptions) error {
	readyW := os.NewFile(fdReady, "ready")
	if readyW == nil {
		return errors.New("__serve is started by 'eli attach', not by hand")
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	// Until it is ready, the server owns neither lock: attach holds them too, and
	// releases the name's (removing its file) once this process has said why it failed.
	// So a failure lets go of both, and only then says so.
	var p store
	pf := os.NewFile(fdProvider, "provider")
	lockf := os.NewFile(fdNameLock, "lock")
	if l := volume.IDLockFromFile(os.NewFile(fdIDLock, "volume-lock")); l != nil {
		heldIDLocks = append(heldIDLocks, l)
	}
	fail := func(err error) error {
		if p != nil {
			p.Close()
		}
		pf.Close() // a second Close of an *os.File does nothing
		releaseIDLocks()
		lockf.Close()
		log.Error("attach failed", "err", err)
		volume.WriteReady(readyW, nil, err)
		return err
	}
	if err := keys.ForbidCoreDumps(); err != nil {
		log.Warn("core dumps stay possible", "err", err)
	}
	cfg, mk, err := volume.ReadSetup(os.NewFile(fdSetup, "setup"))
	if err != nil {
		return fail(err)
	}
	sd, err := volume.ResolveStateDir(g.stateDir)
	if err != nil {
		mk.Wipe()
		return fail(err)
	}
	if cfg.LogFile != "" {
		log = slog.New(slog.NewTextHandler(volume.NewRotatingLog(cfg.LogFile, os.Stderr, 0, 1), nil))
	}
	if p, err = serverProvider(pf, cfg, log); err != nil {
		mk.Wipe()
		return fail(err)
	}
	if err := keys.MemoryLockError(); err != nil {
		log.Warn("key memory could not be locked (it may be swapped out)", "err", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	ready := false
	err = volume.Run(ctx, cfg, sd, p, mk, log, func(rec *volume.Record) {
		ready = true
		volume.WriteReady(readyW, rec, nil)
	})
	if !ready {
		return fail(err)
	}
	if err != nil {
		// The status file says it for 'eli detach'; the log says it for the user. Both
		// before the name is free: the next attach of the name starts a new log.
		log.Error("server stopped with an error", "name", cfg.Name, "err", err)
	}
	// The provider's lock goes before the name's: 'eli detach' returns once the name is
	// free, and by then the provider must be free too, or an attach right after a detach
	// finds the provider in use. (Closing a provider on tmpfs unmaps it first, which
	// takes a moment for a large one.)
	p.Close()
	releaseIDLocks()
	sd.NameLockFromFile(lockf, cfg.Name).Release()
	if err != nil {
		return silentError{err} // logged already; the log may be the next server's now
	}
	return nil
}

package main

import (
	"context"
	"encoding/hex"
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
	"time"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/nbdkernel"
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
	autoDetach  bool
	witness     string
	rollback    bool
	slot        int
	cacheMiB    int
	creds       credFlags
	// reencryptRate bounds the sweep of a re-encryption under way that the server
	// resumes (attach only).
	reencryptRate string
	// A remote provider's timeouts (addRemoteFlags).
	ioTimeout    time.Duration
	queueTimeout string
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
  -d, --auto-detach    detach once the last client has disconnected, after at least
                       one connected (geli attach -d); with --device, the kernel's
                       connections are the clients: once the device is disconnected

A volume is served once per host: a second attach is refused, also through another
path to its bytes (a loop device over the image file, a second path to the disk) and
of a copy of it, which has the same volume ID. Attach a copy once the original is
detached; a copy in format version 2 needs a --witness of its own.

A volume attached read-write is not attached read-only beside it, through any path,
nor the other way round: a read-only server would serve what the writer's commits
leave behind it. Read-only attaches of one volume run together.

The passphrase and the key derivation come first, before any lock is taken: an attach
with wrong keys never holds the volume against one with the right ones, and one that
finds the volume held by a command still at work (not a server) waits up to 10 s for it.

A remote PROVIDER (an NBD URI) cannot be flock'ed from here: attach claims it through
an ownership mark that the server heartbeats. If another host's server holds it, attach
waits three heartbeats (about 6 s) and refuses while that heartbeat moves; --force takes
the volume over, and the other server stops writing.

When the remote storage stops answering:
  --io-timeout D       a request unanswered for D (default 30s) has its connection
                       dropped and is sent again on a new one
  --queue-timeout D    a request is held while the storage is away, and fails with
                       EIO once it has waited D in all (default 2m: longer than a
                       storage failover or a gateway restart, short enough that an
                       outage reaches applications as errors, not a hang); 0 fails it
                       at --io-timeout; 'forever' holds it until the storage is back
                       (dm-multipath's queue_if_no_path)
A write or flush that fails stops the volume's writes (authenticated modes) until it
is detached and attached again: with the default, an outage shorter than two minutes
costs clients a pause, not errors. 'eli detach' ends the server within its --timeout
whatever the storage does.`,
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
	f.StringVar(&o.reencryptRate, "reencrypt-max-rate", "", "a re-encryption under way, which the server resumes, moves at most about this much a second (e.g. 50M; default: as fast as clients leave room for)")
	addServeFlags(cmd, o)
	addRemoteFlags(cmd, o)
	return cmd
}

// addRemoteFlags adds the timeouts of a remote provider (attach and onetime).
func addRemoteFlags(cmd *cobra.Command, o *attachOptions) {
	f := cmd.Flags()
	f.DurationVar(&o.ioTimeout, "io-timeout", remote.DefaultRequestTimeout,
		"remote provider: drop a connection whose request goes unanswered this long, and send the request again")
	f.StringVar(&o.queueTimeout, "queue-timeout", defaultQueueTimeout.String(),
		"remote provider: hold requests while the storage is away for this long in all, then fail them with EIO (0: at --io-timeout; 'forever': until it is back)")
}

// defaultQueueTimeout is --queue-timeout's default: it outlasts a storage failover or a
// gateway restart (Ceph's 30 s watch timeout before a restarted gateway takes the image
// back), and stays short enough for an outage to reach applications as errors, as
// open-iscsi's replacement_timeout (120 s) does.
const defaultQueueTimeout = 2 * time.Minute

// remoteOptions are the remote provider's options the flags give.
func (o *attachOptions) remoteOptions(path string) (remote.Options, error) {
	var ro remote.Options
	if o.ioTimeout == 0 {
		o.ioTimeout = remote.DefaultRequestTimeout // not from a flag: the demo
	}
	if o.ioTimeout < 100*time.Millisecond {
		return ro, usagef("--io-timeout %v: give 100ms or more", o.ioTimeout)
	}
	ro.RequestTimeout = o.ioTimeout
	ro.Interval = heartbeatInterval()
	switch q := o.queueTimeout; q {
	case "":
		ro.QueueTimeout = defaultQueueTimeout
	case "forever":
		ro.QueueTimeout = nbdclient.Forever
	default:
		d, err := time.ParseDuration(q)
		if err != nil || d < 0 {
			return ro, usagef("--queue-timeout %q: give a duration (2m, 0) or 'forever'", q)
		}
		ro.QueueTimeout = d
	}
	return ro, nil
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
	f.IntVar(&o.connections, "connections", volume.DefaultDeviceConnections, "connections the kernel device uses (with --device; more than one may go unread for 30 s on kernels without Linux commit e5a30c303b07)")
	f.BoolVar(&o.writeBack, "write-back", false, "with --device: acknowledge writes before their commit (faster; a server crash can then lose acknowledged writes under a flush the kernel re-sends)")
	f.IntVar(&o.cacheMiB, "cache", 64, "metadata cache size in MiB")
	f.BoolVarP(&o.autoDetach, "auto-detach", "d", false,
		"detach once the last client has disconnected, after at least one connected (with --device: once the device is disconnected)")
}

// serveSetup checks the options shared by attach and onetime and builds the server's
// config.
func (o *attachOptions) serveSetup(sd daemon.StateDir, path string) (*daemon.Setup, error) {
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
		name = daemon.DefaultName(abs)
	}
	if err := daemon.ValidName(name); err != nil {
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
	var reencRate int64
	if o.reencryptRate != "" {
		if reencRate, err = parseSize(o.reencryptRate); err != nil || reencRate < 0 {
			return nil, usagef("--reencrypt-max-rate %q: want a size a second, such as 50M (0: no bound)", o.reencryptRate)
		}
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
	ro, err := o.remoteOptions(path)
	if err != nil {
		return nil, err
	}
	cfg := &daemon.Setup{Config: volume.Config{
		RemoteRequestTimeout: ro.RequestTimeout, RemoteQueueTimeout: ro.QueueTimeout, RemoteInterval: ro.Interval,
		Name: name, Provider: abs, Socket: socket, Listen: o.listen,
		TLSCert: absOrEmpty(o.tlsCert), TLSKey: absOrEmpty(o.tlsKey), TLSClientCA: absOrEmpty(o.tlsClientCA),
		InsecureTCP: o.insecureTCP, ReadOnly: o.readOnly, Device: o.device, Connections: o.connections,
		CacheBytes: int64(o.cacheMiB) << 20, AutoDetach: o.autoDetach, ReencryptMaxRate: reencRate,
		// The kernel device re-plugs after a server crash (attach --device again): only
		// writes committed before they were acknowledged survive that.
		WriteThrough: o.device != "" && !o.writeBack,
	}}
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
	sd, err := daemon.ResolveStateDir(g.stateDir)
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
	cfg  *daemon.Setup
	lock *daemon.NameLock
	h    *volume.Handle
	mk   *keys.MasterKey
}

// access is what the attach options ask of the provider.
func (o *attachOptions) access() volume.Access {
	switch {
	case o.readOnly:
		return volume.ReadOnly
	case o.force:
		return volume.Takeover
	}
	return volume.ReadWrite
}

// prepareAttach unlocks the provider, then reserves the name and takes the provider's
// locks: the KDF and the checks against the witness hold nothing that another attach of
// the volume could be waiting for.
func prepareAttach(sd daemon.StateDir, o *attachOptions, path string) (*attachment, error) {
	if o.slot != keys.AnySlot && (o.slot < 0 || o.slot >= keys.NumSlots) {
		return nil, usagef("--slot must be 0 to %d", keys.NumSlots-1)
	}
	cfg, err := o.serveSetup(sd, path)
	if err != nil {
		return nil, err
	}
	o.creds.volume = cfg.Name // the password agent's question names it
	popts := &volume.ProviderOptions{Remote: cfg.RemoteOptions(nil)}
	ins, hdr, err := openHeader(path, volume.Inspect)
	if err != nil {
		return nil, err
	}
	if err := attachable(sd, o, cfg.Name, path, hdr); err != nil {
		ins.Close()
		return nil, err
	}
	if hdr.Layout.Version >= 2 {
		if cfg.Witness, err = witnessPath(o.witness, hdr.VolumeID); err != nil {
			ins.Close()
			return nil, err
		}
		cfg.AcceptRollback = o.rollback
		if !o.rollback {
			if err := volume.CheckWitness(cfg.Witness, ins.Provider(), hdr); err != nil {
				ins.Close()
				return nil, err
			}
		}
	} else if o.witness != "" || o.rollback {
		warnf("%s: a format version 1 volume has no generation to witness; --witness and --accept-rollback do nothing", path)
	}
	mk, _, err := unlock(hdr, o.creds, o.slot, &stdinGuard{})
	ins.Close()
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			mk.Wipe()
		}
	}()
	if w := modeWarning(hdr.Mode); w != "" {
		warnf("%s: %s", path, w)
	}
	lock, err := lockName(sd, cfg.Name)
	if err != nil {
		return nil, err
	}
	popts.Expect = hdr
	h, err := openProvider(path, o.access(), popts)
	if err != nil {
		lock.Release()
		return nil, err
	}
	cfg.VolumeID = hdr.VolumeID
	ok = true
	return &attachment{cfg: cfg, lock: lock, h: h, mk: mk}, nil
}

// attachable refuses, before the passphrase is asked for, what the locks would refuse
// after it: the volume served already (through any path: its ID), or the name taken by
// another volume's server.
func attachable(sd daemon.StateDir, o *attachOptions, name, path string, hdr *keys.Header) error {
	if rec := sd.Serving(hdr.VolumeID); rec != nil && !o.force && !(o.readOnly && rec.ReadOnly) {
		how := "open for writing"
		if rec.ReadOnly {
			how = "open read-only"
		}
		return fmt.Errorf("%s is in use: volume %x is already %s on this host: already attached as %s (pid %d; see 'eli list')",
			path, hdr.VolumeID, how, rec.Name, rec.Pid)
	}
	if sd.Alive(name) {
		if rec, err := sd.ReadRecord(name); err == nil && rec.VolumeID != hex.EncodeToString(hdr.VolumeID[:]) {
			return fmt.Errorf("the name %s is attached to %s (pid %d): choose another with --name", name, rec.Provider, rec.Pid)
		}
	}
	return nil
}

// lockName reserves a name, waiting a moment for an attach of it that has not finished,
// and clears what an earlier server of that name left.
func lockName(sd daemon.StateDir, name string) (*daemon.NameLock, error) {
	lock, err := sd.LockNameWait(name, 0)
	if err != nil {
		return nil, err
	}
	sd.Cleanup(name, nil, true) // whatever a killed or failed server left behind
	return lock, nil
}

// release lets go of the provider, its volume's ID and the name, in that order: once
// the name is free (which is what 'eli detach' waits for), the volume must be free too.
func (a *attachment) release() {
	a.h.Close()
	a.lock.Release()
}

// serve serves in this process (--foreground) or starts the background server and waits
// until it reports that the export is ready. Either way the provider and the name are
// free again when it returns, unless a background server holds them.
func (a *attachment) serve(cmd *cobra.Command, sd daemon.StateDir, foreground bool) error {
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
		err := daemon.Run(ctx, a.cfg, sd, a.h.Provider(), a.mk, log, func(rec *daemon.Record) {
			ready = true
			a.h.MarkServing()
			printReady(cmd.OutOrStdout(), rec, a.cfg)
			svc.ready(rec)
		})
		if err != nil && ready {
			return finalError(sd, a.cfg.Name, err)
		}
		return err
	}
	in, err := a.h.Handoff()
	if err != nil {
		a.mk.Wipe()
		a.release()
		return err
	}
	a.cfg.Owner = in.Owner // the server heartbeats the remote mark from now on
	rec, err := spawnServer(sd, a.cfg, in, a.lock, a.mk)
	a.mk.Wipe()
	a.h.Close() // this process's descriptors: the server holds the locks, if it started
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
func finalError(sd daemon.StateDir, name string, err error) error {
	if st, serr := sd.ReadStatus(name); serr == nil && st.Pid == os.Getpid() {
		if msg := problem(st); msg != "" {
			return errors.New(msg)
		}
	}
	return fmt.Errorf("%s: %w", name, err)
}

// printReady says where the export is; the last line is its unix URI, for scripts. What
// the server found wrong that does not stop it goes to stderr.
func printReady(out io.Writer, rec *daemon.Record, cfg *daemon.Setup) {
	for _, w := range rec.Warnings {
		warnf("%s: %s", rec.Name, w)
	}
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
	fdSetup    = 5 // read end of a pipe: daemon.WriteSetup
	fdReady    = 6 // write end of a pipe: daemon.WriteReady once ready (or failed)
	fdIDLock   = 7 // the volume's host-wide ID lock (volume.OpenProvider) taken by attach, or /dev/null
)

// spawnServer re-executes eli as the background server. The master key goes through a
// pipe, never argv or the environment; the provider, the name lock and the volume's ID
// lock are inherited already locked, so no other attach can slip in between.
func spawnServer(sd daemon.StateDir, cfg *daemon.Setup, in volume.Inherited, lock *daemon.NameLock, mk *keys.MasterKey) (*daemon.Record, error) {
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
	// A descriptor that is not handed on is /dev/null: it must be there, or the server
	// could take whatever the runtime opens first for it. (A remote provider is
	// reconnected by the server from cfg.Provider; /dev/null is no lock.)
	provFile, idFile := in.Provider, in.IDLock
	for _, f := range []**os.File{&provFile, &idFile} {
		if *f == nil {
			if *f, err = os.Open(os.DevNull); err != nil {
				return nil, err
			}
			defer (*f).Close()
		}
	}
	child.ExtraFiles = []*os.File{provFile, lock.File(), setupR, readyW, idFile}
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	child.Env = append(os.Environ(), "ELI_STATE_DIR="+sd.Path)
	// Until the server has written its pid into the name's lock, the lock names this
	// process, and 'eli detach' signals it: a stop asked of this process meanwhile
	// (detach's SIGTERM, a Ctrl-C, a supervisor's stop) goes on to the server, or the
	// attach would end alone and leave its server serving, holding the name. This
	// process then ends when the server does, saying that it did not start.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	stopForwarding := make(chan struct{})
	defer func() {
		signal.Stop(sigs)
		close(stopForwarding)
	}()
	if err := child.Start(); err != nil {
		return nil, fmt.Errorf("start server: %w", err)
	}
	go func() {
		for {
			select {
			case sig := <-sigs:
				child.Process.Signal(sig)
			case <-stopForwarding:
				return
			}
		}
	}()
	readyW.Close()
	setupR.Close()

	werr := daemon.WriteSetup(setupW, cfg, mk)
	setupW.Close()
	if werr != nil {
		child.Process.Kill()
		child.Wait()
		return nil, fmt.Errorf("hand the key to the server: %w", werr)
	}
	rec, err := daemon.ReadReady(readyR)
	if err == nil {
		// The child is the server and outlives us: release it, not wait for it.
		child.Process.Release()
		return rec, nil
	}
	// A child that failed exits at once; waiting for it means that its locks, which it
	// may not have reached the point of closing in order, are gone when attach returns.
	child.Wait()
	if errors.Is(err, daemon.ErrNoReady) {
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
	var h *volume.Handle
	pf := os.NewFile(fdProvider, "provider")
	lockf := os.NewFile(fdNameLock, "lock")
	idf := os.NewFile(fdIDLock, "volume-lock")
	fail := func(err error) error {
		if h != nil {
			h.Close()
		} else {
			pf.Close()
			idf.Close()
		}
		lockf.Close()
		err = explain(err)
		log.Error("attach failed", "err", err)
		daemon.WriteReady(readyW, nil, err)
		return err
	}
	if err := keys.ForbidCoreDumps(); err != nil {
		log.Warn("core dumps stay possible", "err", err)
	}
	cfg, mk, err := daemon.ReadSetup(os.NewFile(fdSetup, "setup"))
	if err != nil {
		return fail(err)
	}
	sd, err := daemon.ResolveStateDir(g.stateDir)
	if err != nil {
		mk.Wipe()
		return fail(err)
	}
	if cfg.LogFile != "" {
		log = slog.New(slog.NewTextHandler(daemon.NewRotatingLog(cfg.LogFile, os.Stderr, 0, 1), nil))
	}
	nameLock := sd.NameLockFromFile(lockf, cfg.Name) // names this process as the holder
	access := volume.ReadWrite
	if cfg.ReadOnly {
		access = volume.ReadOnly
	}
	h, err = volume.AdoptProvider(cfg.Provider, access, volume.Inherited{Provider: pf, IDLock: idf, Owner: cfg.Owner},
		cfg.VolumeID, &volume.ProviderOptions{Remote: cfg.RemoteOptions(func(format string, args ...any) {
			log.Warn(fmt.Sprintf(format, args...), "provider", cfg.Provider)
		})})
	if err != nil {
		h = nil
		mk.Wipe()
		return fail(err)
	}
	if err := keys.MemoryLockError(); err != nil {
		log.Warn("key memory could not be locked (it may be swapped out)", "err", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	ready := false
	err = daemon.Run(ctx, cfg, sd, h.Provider(), mk, log, func(rec *daemon.Record) {
		ready = true
		if err := h.MarkServing(); err != nil {
			log.Warn("volume lock: cannot say the volume is served", "err", err)
		}
		daemon.WriteReady(readyW, rec, nil)
	})
	if !ready {
		return fail(err)
	}
	if err != nil {
		// The status file says it for 'eli detach'; the log says it for the user. Both
		// before the name is free: the next attach of the name starts a new log.
		log.Error("server stopped with an error", "name", cfg.Name, "err", err)
	}
	// The provider's locks go before the name's: 'eli detach' returns once the name is
	// free, and by then the provider must be free too, or an attach right after a detach
	// finds the provider in use. (Closing a provider on tmpfs unmaps it first, which
	// takes a moment for a large one; a remote one releases its ownership mark, within
	// volume.ReleaseTimeout.)
	if cerr := h.Close(); cerr != nil {
		log.Warn("let go of the provider", "err", cerr)
	}
	nameLock.Release()
	if err != nil {
		return silentError{err} // logged already; the log may be the next server's now
	}
	return nil
}

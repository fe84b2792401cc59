package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
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
	foreground  bool
	device      string
	connections int
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
  --device /dev/nbdN   also connect the kernel's NBD driver (needs the nbd module)
  --foreground         serve in this process until SIGTERM or SIGINT (systemd,
                       containers); logs go to stderr`,
		Example: `  eli attach disk.img
  nbdinfo "$(eli attach --passphrase-file pass.txt disk.img | tail -1)"
  eli attach --device /dev/nbd0 disk.img && mount /dev/nbd0 /mnt
  eli attach --listen 0.0.0.0:10809 --tls-cert srv.pem --tls-key srv.key --tls-client-ca ca.pem disk.img`,
		Args: exactArgs("PROVIDER"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runAttach(cmd, g, o, args[0])
		},
	}
	f := cmd.Flags()
	addCredFlags(cmd, &o.creds, "j", "k", "p")
	addCPUProfileFlag(cmd)
	f.IntVarP(&o.slot, "slot", "n", keys.AnySlot, "try only keyslot N (0-7)")
	f.BoolVarP(&o.readOnly, "readonly", "r", false, "serve read-only")
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
	f.StringVar(&o.device, "device", "", "also connect /dev/nbdN through the kernel's NBD driver")
	f.IntVar(&o.connections, "connections", 4, "connections the kernel device uses (with --device)")
	f.IntVar(&o.cacheMiB, "cache", 64, "metadata cache size in MiB")
}

// serveSetup checks the options shared by attach and onetime and builds the serveConfig.
func (o *attachOptions) serveSetup(sd stateDir, path string) (*serveConfig, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	name := o.name
	if name == "" {
		name = defaultName(abs)
	}
	if err := validName(name); err != nil {
		return nil, err
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
	if o.device != "" {
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
		socket = sd.file(name, ".sock")
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
	cfg := &serveConfig{
		Name: name, Provider: abs, Socket: socket, Listen: o.listen,
		TLSCert: absOrEmpty(o.tlsCert), TLSKey: absOrEmpty(o.tlsKey), TLSClientCA: absOrEmpty(o.tlsClientCA),
		InsecureTCP: o.insecureTCP, ReadOnly: o.readOnly, Device: o.device, Connections: o.connections,
		CacheBytes: int64(o.cacheMiB) << 20,
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
	sd, err := resolveStateDir(g)
	if err != nil {
		return err
	}
	a, err := prepareAttach(sd, o, path)
	if err != nil {
		return err
	}
	defer a.close()
	return serveOrSpawn(cmd, sd, a.cfg, o.foreground, a.p, a.lock, a.mk)
}

// attachment is an unlocked provider, ready to be served.
type attachment struct {
	cfg  *serveConfig
	lock *nameLock
	p    *provider.File
	mk   *keys.MasterKey
}

func (a *attachment) close() {
	a.mk.Wipe()
	a.p.Close()
	a.lock.release()
}

// prepareAttach reserves the name, locks and unlocks the provider.
func prepareAttach(sd stateDir, o *attachOptions, path string) (*attachment, error) {
	if o.slot != keys.AnySlot && (o.slot < 0 || o.slot >= keys.NumSlots) {
		return nil, usagef("--slot must be 0 to %d", keys.NumSlots-1)
	}
	cfg, err := o.serveSetup(sd, path)
	if err != nil {
		return nil, err
	}
	lock, err := sd.lockName(cfg.Name)
	if errors.Is(err, errNameTaken) {
		return nil, fmt.Errorf("the name %s is already attached (see 'eli list'); choose another with --name", cfg.Name)
	}
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			lock.release()
		}
	}()
	sd.cleanup(cfg.Name, nil) // whatever a killed server left behind

	p, h, err := openHeader(path, o.readOnly)
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
	if h.Mode.Unsafe() {
		warnf("%s uses %s, which is UNSAFE: its keystream is fixed per sector, so two versions of a sector "+
			"(or one known plaintext) reveal its contents. Use it for benchmarks only.", path, h.Mode)
	}
	cfg.VolumeID = h.VolumeID
	ok = true
	return &attachment{cfg: cfg, lock: lock, p: p, mk: mk}, nil
}

// serveOrSpawn serves in this process (--foreground) or starts the background server and
// waits until it reports that the export is ready.
func serveOrSpawn(cmd *cobra.Command, sd stateDir, cfg *serveConfig, foreground bool, p *provider.File, lock *nameLock, mk *keys.MasterKey) error {
	if foreground {
		log := slog.New(slog.NewTextHandler(os.Stderr, nil))
		if err := keys.ForbidCoreDumps(); err != nil {
			log.Warn("core dumps stay possible", "err", err)
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
		defer stop()
		return runServer(ctx, cfg, sd, p, mk, log, func(rec *record) {
			printReady(cmd.OutOrStdout(), rec, cfg)
		})
	}
	rec, err := spawnServer(sd, cfg, p, lock, mk)
	if err != nil {
		return err
	}
	printReady(cmd.OutOrStdout(), rec, cfg)
	return nil
}

// printReady says where the export is; the last line is its unix URI, for scripts.
func printReady(out io.Writer, rec *record, cfg *serveConfig) {
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

// runServer serves until ctx ends; ready is called once clients can connect.
func runServer(ctx context.Context, cfg *serveConfig, sd stateDir, p *provider.File, mk *keys.MasterKey, log *slog.Logger, ready func(*record)) error {
	srv, err := startServer(cfg, p, mk, log)
	mk.Wipe() // the codec and the device hold what they need
	if err != nil {
		return err
	}
	if err := sd.writeRecord(srv.rec); err != nil {
		srv.stop(context.Background())
		return err
	}
	ready(srv.rec)
	werr := srv.wait(ctx)
	serr := srv.stop(context.Background())
	sd.cleanup(cfg.Name, srv.rec)
	if werr != nil {
		return werr
	}
	return serr
}

// The background server inherits, besides stdin/stdout/stderr (all /dev/null or its log):
const (
	fdProvider = 3 // the provider, opened and flock'ed by attach
	fdNameLock = 4 // the state directory's NAME.lock, flock'ed by attach
	fdSetup    = 5 // read end of a pipe: u32 length, config JSON, master key
	fdReady    = 6 // write end of a pipe: one JSON line once ready (or failed)
)

type readyMsg struct {
	Record *record `json:"record,omitempty"`
	Error  string  `json:"error,omitempty"`
}

// spawnServer re-executes eli as the background server. The master key goes through a
// pipe, never argv or the environment; the provider and the name lock are inherited
// already locked, so no other attach can slip in between.
func spawnServer(sd stateDir, cfg *serveConfig, p *provider.File, lock *nameLock, mk *keys.MasterKey) (*record, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cfg.LogFile = sd.file(cfg.Name, ".log")
	logf, err := os.OpenFile(cfg.LogFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
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
	child.ExtraFiles = []*os.File{p.File(), lock.f, setupR, readyW}
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	child.Env = append(os.Environ(), "ELI_STATE_DIR="+sd.path)
	if err := child.Start(); err != nil {
		return nil, fmt.Errorf("start server: %w", err)
	}
	readyW.Close()
	setupR.Close()

	conf, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	msg := binary.BigEndian.AppendUint32(nil, uint32(len(conf)))
	msg = append(msg, conf...)
	msg = append(msg, mk.Bytes()...)
	_, werr := setupW.Write(msg)
	clear(msg)
	setupW.Close()
	if werr != nil {
		child.Process.Kill()
		child.Wait()
		return nil, fmt.Errorf("hand the key to the server: %w", werr)
	}

	// The child's exit is not awaited: it is the server and outlives us. Release it.
	defer child.Process.Release()
	line, rerr := io.ReadAll(io.LimitReader(readyR, 64<<10))
	var rm readyMsg
	if rerr != nil || json.Unmarshal(line, &rm) != nil {
		tail := logTail(cfg.LogFile)
		return nil, fmt.Errorf("server exited before it was ready%s", tail)
	}
	if rm.Error != "" {
		return nil, errors.New(rm.Error)
	}
	if rm.Record == nil {
		return nil, fmt.Errorf("server said it was ready but sent no record%s", logTail(cfg.LogFile))
	}
	return rm.Record, nil
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
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	readyW := os.NewFile(fdReady, "ready")
	fail := func(err error) error {
		b, _ := json.Marshal(readyMsg{Error: err.Error()})
		readyW.Write(append(b, '\n'))
		readyW.Close()
		log.Error("attach failed", "err", err)
		return err
	}
	if readyW == nil {
		return errors.New("__serve is started by 'eli attach', not by hand")
	}
	if err := keys.ForbidCoreDumps(); err != nil {
		log.Warn("core dumps stay possible", "err", err)
	}
	cfg, mk, err := readSetup(os.NewFile(fdSetup, "setup"))
	if err != nil {
		return fail(err)
	}
	sd, err := resolveStateDir(g)
	if err != nil {
		mk.Wipe()
		return fail(err)
	}
	// The name lock goes last: 'eli detach' returns once it is free, and by then the
	// provider's lock must be free too, or an attach right after a detach finds the
	// provider in use. (Closing a provider on tmpfs unmaps it first, which takes a
	// moment for a large one: long enough for TestLifecycle to catch the wrong order.)
	lockf := os.NewFile(fdNameLock, "lock")
	defer lockf.Close()
	pf := os.NewFile(fdProvider, cfg.Provider)
	p, err := provider.FromFile(pf, cfg.Provider)
	if err != nil {
		mk.Wipe()
		return fail(err)
	}
	defer p.Close()
	if err := keys.MemoryLockError(); err != nil {
		log.Warn("key memory could not be locked (it may be swapped out)", "err", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	err = runServer(ctx, cfg, sd, p, mk, log, func(rec *record) {
		b, _ := json.Marshal(readyMsg{Record: rec})
		readyW.Write(append(b, '\n'))
		readyW.Close()
	})
	if err != nil {
		return fail(err)
	}
	return nil
}

// readSetup reads the config and master key that attach sent.
func readSetup(r io.ReadCloser) (*serveConfig, *keys.MasterKey, error) {
	defer r.Close()
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return nil, nil, fmt.Errorf("read setup: %w", err)
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > 64<<10 {
		return nil, nil, fmt.Errorf("setup of %d bytes is implausible", size)
	}
	conf := make([]byte, size)
	if _, err := io.ReadFull(r, conf); err != nil {
		return nil, nil, fmt.Errorf("read setup: %w", err)
	}
	cfg := &serveConfig{}
	if err := json.Unmarshal(conf, cfg); err != nil {
		return nil, nil, fmt.Errorf("read setup: %w", err)
	}
	key := keys.NewSecret(keys.MasterKeySize)
	defer key.Wipe()
	if _, err := io.ReadFull(r, key.Bytes()); err != nil {
		return nil, nil, fmt.Errorf("read key: %w", err)
	}
	mk, err := keys.NewMasterKey(cfg.VolumeID, key.Bytes())
	if err != nil {
		return nil, nil, err
	}
	if cfg.Onetime && !cfg.Mode.Valid() {
		mk.Wipe()
		return nil, nil, fmt.Errorf("setup names an invalid mode")
	}
	return cfg, mk, nil
}

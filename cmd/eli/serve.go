package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/layout"
	"github.com/elidisk/eli/nbd"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/sector"
)

// serveConfig is everything the server needs besides the provider, the name lock and the
// master key. The background server receives it as JSON from `eli attach`; it holds no
// secret.
type serveConfig struct {
	Name        string `json:"name"`
	Provider    string `json:"provider"`
	Socket      string `json:"socket"`
	Listen      string `json:"listen,omitempty"`
	TLSCert     string `json:"tls_cert,omitempty"`
	TLSKey      string `json:"tls_key,omitempty"`
	TLSClientCA string `json:"tls_client_ca,omitempty"`
	InsecureTCP bool   `json:"insecure_tcp,omitempty"`
	ReadOnly    bool   `json:"readonly,omitempty"`
	Device      string `json:"device,omitempty"`
	Connections int    `json:"connections,omitempty"`
	CacheBytes  int64  `json:"cache_bytes,omitempty"`
	LogFile     string `json:"log_file,omitempty"`

	// Onetime volumes have no header: the mode and sector size come from here, and the
	// provider is formatted by the server before it is served.
	Onetime    bool        `json:"onetime,omitempty"`
	Mode       sector.Mode `json:"mode,omitempty"`
	SectorSize int         `json:"sector_size,omitempty"`
	VolumeID   [16]byte    `json:"volume_id"`
}

// volume is an open, attached volume: its device and what to wipe when it closes.
type volume struct {
	dev   *blockdev.Device
	codec sector.Codec
	mode  sector.Mode
}

// openVolume builds the codec and the device for an unlocked provider.
func openVolume(cfg *serveConfig, p *provider.File, mk *keys.MasterKey, log *slog.Logger) (*volume, error) {
	var l layout.Layout
	var mode sector.Mode
	if cfg.Onetime {
		var err error
		mode = cfg.Mode
		l, err = layout.Plan(p.Size(), cfg.SectorSize, mode, 0)
		if err != nil {
			return nil, err
		}
		if err := blockdev.Format(p, l); err != nil {
			return nil, fmt.Errorf("prepare onetime volume: %w", err)
		}
	} else {
		h, err := keys.Read(p)
		if err != nil {
			return nil, err
		}
		if err := h.Verify(mk); err != nil {
			return nil, err
		}
		if err := h.Layout.Validate(p.Size()); err != nil {
			return nil, err
		}
		mode = h.Mode
		l = h.Layout
	}
	dk := mk.DataKey(mode)
	defer dk.Wipe()
	codec, err := sector.New(sector.Params{Mode: mode, SectorSize: l.SectorSize, Key: dk.Bytes(), VolumeID: mk.VolumeID()})
	if err != nil {
		return nil, err
	}
	jk := mk.JournalKey()
	defer jk.Wipe()
	dev, err := blockdev.Open(p, blockdev.Config{
		Layout:     l,
		Codec:      codec,
		JournalKey: jk.Bytes(),
		ReadOnly:   cfg.ReadOnly,
		CacheBytes: cfg.CacheBytes,
		Logger:     log,
	})
	if err != nil {
		codec.Wipe()
		return nil, err
	}
	return &volume{dev: dev, codec: codec, mode: mode}, nil
}

func (v *volume) close() error {
	err := v.dev.Close()
	v.codec.Wipe()
	return err
}

// backend adapts a blockdev.Device to nbd.Backend (their flag bits are the same).
type backend struct{ d *blockdev.Device }

func (b backend) Size() int64                      { return b.d.Size() }
func (b backend) ReadAt(p []byte, off int64) error { return b.d.ReadAt(p, off) }
func (b backend) Flush() error                     { return b.d.Flush() }
func (b backend) WriteAt(p []byte, off int64, f nbd.Flags) error {
	return b.d.WriteAt(p, off, blockdev.Flags(f))
}
func (b backend) WriteZeroes(off, n int64, f nbd.Flags) error {
	return b.d.WriteZeroes(off, n, blockdev.Flags(f))
}
func (b backend) Trim(off, n int64, f nbd.Flags) error { return b.d.Trim(off, n, blockdev.Flags(f)) }

// unixURI is the NBD URI of a unix socket, escaping only what a URI query cannot hold
// literally, so that the common path reads as itself.
func unixURI(socket string) string {
	return "nbd+unix:///?socket=" + uriEscaper.Replace(socket)
}

var uriEscaper = strings.NewReplacer("%", "%25", "&", "%26", "#", "%23", " ", "%20", "+", "%2B", "?", "%3F", "=", "%3D")

// server is a running attachment: listeners, NBD servers, and the optional kernel device.
type server struct {
	cfg       *serveConfig
	vol       *volume
	log       *slog.Logger
	servers   []*nbd.Server
	listeners []net.Listener // not yet handed to a server
	tcpAddr   string         // the TCP listener's address, if any
	errc      chan error
	devIndex  int
	rec       *record
	// keepDevice: stop without disconnecting the kernel device (SIGUSR1), so that the
	// next 'eli attach --device' re-plugs it while the filesystem on it stays mounted.
	keepDevice atomic.Bool
}

// keepDeviceOnSIGUSR1 makes SIGUSR1 stop the server as SIGTERM does (every write
// committed and flushed, the provider closed), but leave the kernel device connected:
// the kernel holds the device's I/O for up to nbdkernel.DeadConnTimeout seconds for a
// new server to re-plug it. 'eli detach --keep-device' sends it.
func (s *server) keepDeviceOnSIGUSR1() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR1)
	go func() {
		<-ch
		s.keepDevice.Store(true)
		syscall.Kill(os.Getpid(), syscall.SIGTERM)
	}()
}

// startServer opens the volume, listens, and connects the kernel device if asked. On
// success the export is ready for clients.
func startServer(cfg *serveConfig, p *provider.File, mk *keys.MasterKey, log *slog.Logger) (*server, error) {
	s := &server{cfg: cfg, log: log, errc: make(chan error, 2), devIndex: -1}
	if cfg.Device != "" {
		s.keepDeviceOnSIGUSR1()
	}
	ok := false
	defer func() {
		if !ok {
			s.stop(context.Background())
		}
	}()
	// Listen before the volume is opened: a socket or port that cannot be used must fail
	// the attach before anything touches the provider.
	ul, err := nbd.ListenUnix(cfg.Socket)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", cfg.Socket, err)
	}
	s.listeners = append(s.listeners, ul)
	var tlsConf *tls.Config
	if cfg.Listen != "" {
		if cfg.TLSCert != "" {
			if tlsConf, err = nbd.TLSConfigFromFiles(cfg.TLSCert, cfg.TLSKey, cfg.TLSClientCA); err != nil {
				return nil, err
			}
		}
		tl, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("listen on %s: %w", cfg.Listen, err)
		}
		s.listeners = append(s.listeners, tl)
		s.tcpAddr = tl.Addr().String() // the port, when cfg.Listen asked for any
	}

	if s.vol, err = openVolume(cfg, p, mk, log); err != nil {
		return nil, err
	}
	d := s.vol.dev
	ss := uint32(d.SectorSize())
	desc := fmt.Sprintf("eli volume %s (%s)", cfg.Name, s.vol.mode)
	exports := []nbd.Export{
		{Name: "", Description: desc, Backend: backend{d}, ReadOnly: cfg.ReadOnly, MinBlock: 1, PreferredBlock: ss, MultiConn: true},
		{Name: cfg.Name + ".eli", Description: desc, Backend: backend{d}, ReadOnly: cfg.ReadOnly, MinBlock: 1, PreferredBlock: ss, MultiConn: true},
	}
	for i, l := range s.listeners {
		srv := &nbd.Server{Exports: exports, Logger: log}
		if i > 0 { // TCP
			srv.TLSConfig, srv.AllowInsecureTCP = tlsConf, cfg.InsecureTCP
			log.Info("listening on TCP", "addr", l.Addr().String(), "tls", tlsConf != nil)
		}
		s.servers = append(s.servers, srv)
		go func() { s.errc <- srv.Serve(l) }()
	}
	s.listeners = nil // the servers own them now

	if cfg.Device != "" {
		idx, err := connectKernel(cfg, d, log)
		if err != nil {
			return nil, err
		}
		s.devIndex = idx
	}

	dev, ino, _ := fileID(cfg.Provider)
	s.rec = &record{
		Name: cfg.Name, Provider: cfg.Provider, Dev: dev, Ino: ino, Mode: s.vol.mode.String(),
		SectorSize: d.SectorSize(), Size: d.Size(), Socket: cfg.Socket, Listen: s.tcpAddr, URI: unixURI(cfg.Socket),
		Device: cfg.Device, DeviceIdx: s.devIndex, ReadOnly: cfg.ReadOnly, Onetime: cfg.Onetime,
		Pid: os.Getpid(), Log: cfg.LogFile,
	}
	r := d.Recovery()
	log.Info("attached", "name", cfg.Name, "provider", cfg.Provider, "mode", s.vol.mode.String(),
		"size", d.Size(), "socket", cfg.Socket, "journal", r.Journal, "recovered_sectors", r.Sectors)
	ok = true
	return s, nil
}

// connectKernel negotiates cfg.Connections sockets with our own server and hands them to
// the kernel's NBD driver.
func connectKernel(cfg *serveConfig, d *blockdev.Device, log *slog.Logger) (int, error) {
	idx, err := nbdkernel.ParseDevice(cfg.Device)
	if err != nil {
		return -1, err
	}
	n := max(cfg.Connections, 1)
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	var flags uint16
	for i := 0; i < n; i++ {
		c, err := nbdclient.Dial("unix", cfg.Socket, "")
		if err != nil {
			return -1, err
		}
		flags = c.Export.Flags
		f, err := c.Conn().(*net.UnixConn).File()
		c.Conn().Close()
		if err != nil {
			return -1, err
		}
		files = append(files, f)
	}
	idx, replugged, err := nbdkernel.Attach(nbdkernel.Config{
		Index: idx, Size: uint64(d.Size()), BlockSize: uint64(d.SectorSize()),
		ServerFlags: flags, TimeoutSeconds: 30, Sockets: files,
		DeadConnTimeoutSeconds: nbdkernel.DeadConnTimeout,
		Backend:                nbdkernel.BackendID(cfg.VolumeID[:]),
	})
	if err != nil {
		return -1, err
	}
	if replugged {
		log.Info("re-plugged the live kernel device", "device", cfg.Device)
	}
	if kib, err := nbdkernel.Tune(idx); err != nil {
		log.Warn("tune kernel device", "device", cfg.Device, "err", err)
	} else {
		log.Info("kernel device", "device", cfg.Device, "max_sectors_kb", kib)
	}
	return idx, nil
}

// wait blocks until ctx ends or a listener fails.
func (s *server) wait(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return nil
	case err := <-s.errc:
		if errors.Is(err, nbd.ErrServerClosed) {
			return nil
		}
		return err
	}
}

// stop disconnects the kernel device, drains and closes every connection (which flushes),
// closes the device (final commit) and wipes the keys it held.
func (s *server) stop(ctx context.Context) error {
	if s.devIndex >= 0 && s.keepDevice.Load() {
		s.log.Info("leaving the kernel device connected for the next attach", "device", s.cfg.Device,
			"dead_conn_timeout_s", nbdkernel.DeadConnTimeout)
	} else if s.devIndex >= 0 {
		if err := nbdkernel.Disconnect(s.devIndex); err != nil {
			s.log.Warn("disconnect kernel device", "device", s.cfg.Device, "err", err)
		}
	}
	for _, l := range s.listeners {
		l.Close()
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, srv := range s.servers {
		shutdown := srv.Shutdown
		if s.keepDevice.Load() {
			shutdown = srv.Handover // the kernel resends what we leave unanswered
		}
		if err := shutdown(ctx); err != nil {
			s.log.Warn("shutdown", "err", err)
		}
	}
	if s.vol == nil {
		return nil
	}
	err := s.vol.close()
	if err != nil {
		s.log.Error("close volume", "err", err)
	} else {
		s.log.Info("detached", "name", s.cfg.Name)
	}
	return err
}

func randomVolumeID() ([16]byte, error) {
	var id [16]byte
	_, err := rand.Read(id[:])
	return id, err
}

package volume

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbd"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/nbdkernel"
	"github.com/elidisk/eli/provider"
	"github.com/elidisk/eli/remote"
	"github.com/elidisk/eli/sector"
)

// Config is everything a server needs besides the provider and the master key. It holds
// no secret, and encodes as JSON (eli's background server receives it so).
type Config struct {
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
	// WriteThrough: see Options.WriteThrough (attach --device sets it unless --write-back).
	WriteThrough bool `json:"write_through,omitempty"`
	// AutoDetach stops the server once its last client has disconnected, after at least
	// one had connected (geli attach -d). With Device the kernel's connections are
	// clients: the server stops when the device is disconnected.
	AutoDetach bool `json:"auto_detach,omitempty"`
	// Witness and AcceptRollback: see Options.
	Witness        string `json:"witness,omitempty"`
	AcceptRollback bool   `json:"accept_rollback,omitempty"`
	CacheBytes     int64  `json:"cache_bytes,omitempty"`
	// ReencryptMaxRate bounds, in bytes a second, the sweep of a re-encryption under way
	// that the server resumes when it starts (0: no bound).
	ReencryptMaxRate int64 `json:"reencrypt_max_rate,omitempty"`

	// Onetime volumes have no header: the mode and sector size come from here, and the
	// provider is formatted by the server before it is served.
	Onetime    bool        `json:"onetime,omitempty"`
	Mode       sector.Mode `json:"mode,omitempty"`
	SectorSize int         `json:"sector_size,omitempty"`
	VolumeID   [16]byte    `json:"volume_id"`

	// RemoteRequestTimeout, RemoteQueueTimeout and RemoteInterval are a remote
	// provider's remote.Options (0: their defaults; a negative queue timeout holds
	// requests without end, nbdclient.Forever).
	RemoteRequestTimeout time.Duration `json:"remote_request_timeout,omitempty"`
	RemoteQueueTimeout   time.Duration `json:"remote_queue_timeout,omitempty"`
	RemoteInterval       time.Duration `json:"remote_interval,omitempty"`
}

// RemoteOptions are the options a remote provider is reached with; logf hears of lost
// connections.
func (cfg *Config) RemoteOptions(logf func(string, ...any)) remote.Options {
	return remote.Options{Logf: logf, RequestTimeout: cfg.RemoteRequestTimeout, QueueTimeout: cfg.RemoteQueueTimeout,
		Interval: cfg.RemoteInterval}
}

// kernelTimeout is the request timeout of the kernel device: 30 s, or for a remote
// provider longer than eli may hold a request for its storage (the kernel would give a
// request up, and drop the connection, while eli still waits for the storage to come
// back), and the longest the kernel takes (nbdkernel.MaxTimeout) when eli holds
// requests without end. Not 0: with more than one connection the 6.1 driver still times
// a request out after 30 s then, and takes its socket down (nbdkernel/timeout.go).
func (cfg *Config) kernelTimeout() uint64 {
	const local = 30
	if !remote.IsURI(cfg.Provider) {
		return local
	}
	if cfg.RemoteQueueTimeout < 0 {
		return uint64(nbdkernel.MaxTimeout / time.Second)
	}
	hold := max(cfg.RemoteQueueTimeout, cfg.RemoteRequestTimeout, remote.DefaultRequestTimeout)
	return max(local, uint64((hold+10*time.Second)/time.Second))
}

// Options are the Open options cfg asks for.
func (cfg *Config) Options(log *slog.Logger) Options {
	o := Options{ReadOnly: cfg.ReadOnly, CacheBytes: cfg.CacheBytes, Logger: log, WriteThrough: cfg.WriteThrough,
		Witness: cfg.Witness, AcceptRollback: cfg.AcceptRollback}
	if cfg.Onetime {
		o.Onetime = &Onetime{Mode: cfg.Mode, SectorSize: cfg.SectorSize}
	}
	return o
}

// UnixURI is the NBD URI of a unix socket, escaping only what a URI query cannot hold
// literally, so that the common path reads as itself.
func UnixURI(socket string) string {
	return "nbd+unix:///?socket=" + uriEscaper.Replace(socket)
}

var uriEscaper = strings.NewReplacer("%", "%25", "&", "%26", "#", "%23", " ", "%20", "+", "%2B", "?", "%3F", "=", "%3D")

// Server serves one Volume: NBD on a unix socket and, if asked, on TCP (with TLS), and
// the kernel's NBD device. Listen binds the sockets, Start serves a volume on them,
// Shutdown stops everything and closes the volume; in between Wait blocks.
type Server struct {
	cfg       *Config
	log       *slog.Logger
	vol       *Volume
	servers   []*nbd.Server
	listeners []net.Listener // not yet handed to a server
	tlsConf   *tls.Config
	tcpAddr   string // the TCP listener's address, if any
	errc      chan error
	devIndex  int
	closed    bool  // Shutdown closed the volume
	closeErr  error // and this is what Close said
	// keepDevice: Shutdown leaves the kernel device connected (and hands its requests
	// over unanswered), so that the next attach re-plugs it while it stays mounted.
	keepDevice atomic.Bool
	// kdev keeps the kernel device's sockets, whose send timeout a suspend raises
	// (suspend.go); susMu orders Suspend, Resume and the start of Shutdown, which
	// disconnects the device and closes kdev: stopping says it has begun (under susMu).
	// stopped ends at Shutdown, and with it a Suspend under way, so that Shutdown need
	// not wait for the suspend's deadline.
	kdev     kernelDevice
	susMu    sync.Mutex
	stopping bool
	stopped  context.Context
	stop     context.CancelFunc
	// The clients of each NBD server, for AutoDetach: idle is closed once they were
	// more than none and are none again.
	clientsMu sync.Mutex
	clients   []int
	connected bool
	idle      chan struct{}
}

// KeepDevice makes Shutdown leave the kernel device connected: the kernel holds its I/O
// for up to nbdkernel.DeadConnTimeout seconds, for 'eli attach --device' to plug a new
// server in (a restart or an upgrade without unmounting). Every write is still committed
// and flushed before Shutdown returns.
func (s *Server) KeepDevice() { s.keepDevice.Store(true) }

// Start listens, opens the volume on the unlocked provider p, and serves it: the export
// is ready for clients when it returns. mk is wiped once the volume is open; Shutdown
// stops the server and closes the volume.
func Start(cfg *Config, p provider.Provider, mk *keys.MasterKey, log *slog.Logger) (*Server, error) {
	srv, err := Listen(cfg, log)
	if err != nil {
		mk.Wipe()
		return nil, err
	}
	v, err := Open(p, mk, cfg.Options(log))
	mk.Wipe() // the codec and the device hold what they need
	if err != nil {
		srv.closeListeners()
		return nil, err
	}
	if err := srv.Start(v); err != nil {
		v.Close()
		return nil, err
	}
	return srv, nil
}

// Listen binds the server's sockets. It comes before the volume is opened: a socket or
// port that cannot be used must fail the attach before anything touches the provider.
func Listen(cfg *Config, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, log: log, errc: make(chan error, 2), devIndex: -1, idle: make(chan struct{})}
	s.stopped, s.stop = context.WithCancel(context.Background())
	ul, err := nbd.ListenUnix(cfg.Socket)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", cfg.Socket, err)
	}
	s.listeners = append(s.listeners, ul)
	if cfg.Listen != "" {
		if cfg.TLSCert != "" {
			if s.tlsConf, err = nbd.TLSConfigFromFiles(cfg.TLSCert, cfg.TLSKey, cfg.TLSClientCA); err != nil {
				s.closeListeners()
				return nil, err
			}
		}
		tl, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			s.closeListeners()
			return nil, fmt.Errorf("listen on %s: %w", cfg.Listen, err)
		}
		s.listeners = append(s.listeners, tl)
		s.tcpAddr = tl.Addr().String() // the port, when cfg.Listen asked for any
	}
	return s, nil
}

func (s *Server) closeListeners() {
	for _, l := range s.listeners {
		l.Close()
	}
	s.listeners = nil
}

// Start serves v on the listeners and connects the kernel device if the config names
// one. On success the export is ready for clients, and the server owns v: Shutdown
// closes it. On failure Start stops what it started, and v is the caller's to close.
func (s *Server) Start(v *Volume) error {
	s.vol = v
	ss := uint32(v.SectorSize())
	desc := fmt.Sprintf("eli volume %s (%s)", s.cfg.Name, v.Mode())
	exports := []nbd.Export{
		{Name: "", Description: desc, Backend: v, ReadOnly: s.cfg.ReadOnly, MinBlock: 1, PreferredBlock: ss, MultiConn: true},
		{Name: s.cfg.Name + ".eli", Description: desc, Backend: v, ReadOnly: s.cfg.ReadOnly, MinBlock: 1, PreferredBlock: ss, MultiConn: true},
	}
	s.clients = make([]int, len(s.listeners))
	for i, l := range s.listeners {
		srv := &nbd.Server{Exports: exports, Logger: s.log}
		if s.cfg.AutoDetach {
			srv.OnClients = func(n int) { s.countClients(i, n) }
		}
		if i > 0 { // TCP
			srv.TLSConfig, srv.AllowInsecureTCP = s.tlsConf, s.cfg.InsecureTCP
			s.log.Info("listening on TCP", "addr", l.Addr().String(), "tls", s.tlsConf != nil)
		}
		s.servers = append(s.servers, srv)
		go func() { s.errc <- srv.Serve(l) }()
	}
	s.listeners = nil // the servers own them now

	if s.cfg.Device != "" {
		idx, err := s.connectKernel()
		if err != nil {
			s.vol = nil
			s.stopServing(context.Background())
			return err
		}
		s.devIndex = idx
	}

	r := v.Recovery()
	s.log.Info("attached", "name", s.cfg.Name, "provider", s.cfg.Provider, "mode", v.Mode().String(),
		"size", v.Size(), "socket", s.cfg.Socket, "journal", r.Journal, "recovered_sectors", r.Sectors)
	// A re-encryption that Open found under way goes on as the volume serves.
	v.resumePending(ReencryptOptions{MaxRate: s.cfg.ReencryptMaxRate})
	return nil
}

// TCPAddr is the TCP listener's address (its port, when the config asked for any),
// or "" without one.
func (s *Server) TCPAddr() string { return s.tcpAddr }

// DeviceIndex is the kernel device's index (N of /dev/nbdN), or -1 without one.
func (s *Server) DeviceIndex() int { return s.devIndex }

// Volume is the volume being served.
func (s *Server) Volume() *Volume { return s.vol }

// DefaultDeviceConnections is how many sockets a kernel device gets unless Config asks
// for more: one, because Linux 6.1's driver may leave every connection after the first
// unread for its request timeout when its workqueue is slow to make a worker (at boot,
// on a loaded machine; docs/design.md, "A connection the kernel does not read"), and one
// connection carries many requests in flight, which the server runs concurrently.
const DefaultDeviceConnections = 1

// connectKernel negotiates cfg.Connections sockets with our own server and hands them to
// the kernel's NBD driver.
func (s *Server) connectKernel() (int, error) {
	idx, err := nbdkernel.ParseDevice(s.cfg.Device)
	if err != nil {
		return -1, err
	}
	n := s.cfg.Connections
	if n < 1 {
		n = DefaultDeviceConnections
	}
	var files []*os.File // the kernel's ends, closed once the kernel and kdev have theirs
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	var flags uint16
	for i := 0; i < n; i++ {
		c, err := nbdclient.Dial("unix", s.cfg.Socket, "")
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
	backend := nbdkernel.BackendID(s.cfg.VolumeID[:])
	idx, replugged, err := nbdkernel.Attach(nbdkernel.Config{
		Index: idx, Size: uint64(s.vol.Size()), BlockSize: uint64(s.vol.SectorSize()),
		ServerFlags: flags, TimeoutSeconds: s.cfg.kernelTimeout(), Sockets: files,
		DeadConnTimeoutSeconds: nbdkernel.DeadConnTimeout,
		Backend:                backend,
	})
	if err != nil {
		return -1, err
	}
	// The sockets' send timeout can be changed only through them: a suspend raises it.
	if kdev, err := nbdkernel.NewDevice(idx, backend, files); err != nil {
		s.log.Warn("keep the kernel device's sockets: a suspend will be refused", "device", s.cfg.Device, "err", err)
	} else {
		s.kdev = kdev
	}
	if replugged {
		s.log.Info("re-plugged the live kernel device", "device", s.cfg.Device)
	}
	if kib, err := nbdkernel.Tune(idx); err != nil {
		s.log.Warn("tune kernel device", "device", s.cfg.Device, "err", err)
	} else {
		s.log.Info("kernel device", "device", s.cfg.Device, "max_sectors_kb", kib)
	}
	s.checkReceiving(idx, n)
	return idx, nil
}

// receiveGrace is how long a connected kernel device's receive loops may take to start
// before the server says that some will not (nbdkernel.ReceiveLoops).
const receiveGrace = 2 * time.Second

// checkReceiving waits until the kernel runs a receive loop for each of the device's n
// connections, and says so if it does not within receiveGrace: the kernel then reads no
// reply on some connections, and each request it sends there waits for its request
// timeout (a mount or a boot then waits for it). Nothing the server does fixes it.
func (s *Server) checkReceiving(idx, n int) {
	deadline := time.Now().Add(receiveGrace)
	for {
		got, err := nbdkernel.ReceiveLoops(idx)
		if err != nil {
			s.log.Debug("count the kernel device's receive loops", "device", s.cfg.Device, "err", err)
			return
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			s.log.Warn("the kernel reads replies on only some of the device's connections: each request it sends on the others waits for its request timeout, then moves to a connection it reads. "+
				"Linux's workqueue rescuer ran the device's receive loops one after another because the kernel was slow to create a thread (fixed in Linux by commit e5a30c303b07); a device with one connection cannot meet it",
				"device", s.cfg.Device, "connections", n, "receiving", got, "request_timeout", time.Duration(s.cfg.kernelTimeout())*time.Second)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// countClients records that NBD server i has n clients, and closes idle when every
// server has none after some had (AutoDetach).
func (s *Server) countClients(i, n int) {
	s.clientsMu.Lock()
	defer s.clientsMu.Unlock()
	s.clients[i] = n
	total := 0
	for _, c := range s.clients {
		total += c
	}
	switch {
	case total > 0:
		s.connected = true
	case s.connected:
		s.connected = false
		s.log.Info("the last client disconnected: detaching (auto-detach)", "name", s.cfg.Name)
		select {
		case <-s.idle:
		default:
			close(s.idle)
		}
	}
}

// Wait blocks until ctx ends, a listener fails, or, with AutoDetach, the last client
// has disconnected.
func (s *Server) Wait(ctx context.Context) error {
	select {
	case <-s.idle:
		return nil
	case <-ctx.Done():
		return nil
	case err := <-s.errc:
		if errors.Is(err, nbd.ErrServerClosed) {
			return nil
		}
		return err
	}
}

// Shutdown disconnects the kernel device (this is the one place that does), drains and
// closes every connection, and closes the volume: the final commit and flush, and the
// wiping of its keys. Its error is the volume's final status; nil means every write the
// server acknowledged is on the provider. Connections still busy when ctx ends (30 s at
// most) are closed. A provider that can bound its I/O (a remote one, Deadliner) ends
// every request by ctx's deadline, so that Shutdown ends whatever the storage does.
//
// A suspended volume's requests are held and cannot be served without its keys, and
// every write it acknowledged is on the provider already. They are failed with
// ESHUTDOWN (they were never acknowledged), or, when the kernel device is kept for the
// next server (KeepDevice), left unanswered: the kernel sends them again to the server
// that re-plugs it.
//
// A Suspend under way gives up (ErrStopping) and Shutdown waits for it to return; a
// Suspend or a Resume from then on is refused with ErrStopping.
func (s *Server) Shutdown(ctx context.Context) error {
	if d, ok := ctx.Deadline(); ok && s.vol != nil && s.vol.deadliner != nil {
		s.vol.deadliner.SetDeadline(d)
	}
	s.stop()
	s.susMu.Lock()
	s.stopping = true
	s.susMu.Unlock()
	if s.vol != nil && !s.closed {
		if ok, _ := s.vol.Suspended(); ok {
			if s.keepDevice.Load() {
				// Cut the connections before the held requests fail: their replies
				// then never reach the kernel.
				cut, cancel := context.WithCancel(ctx)
				cancel()
				s.stopServing(cut)
			}
			s.closeVolume()
		}
	}
	s.stopServing(ctx)
	if s.vol == nil || s.closed {
		return s.closeErr
	}
	return s.closeVolume()
}

// closeVolume closes the volume once and logs its final status.
func (s *Server) closeVolume() error {
	s.closed = true
	err := s.vol.Close()
	s.closeErr = err
	if err != nil {
		s.log.Error("final commit and flush failed", "name", s.cfg.Name, "err", err)
	} else {
		s.log.Info("detached", "name", s.cfg.Name)
	}
	return err
}

// inUse is nbdkernel.InUse; tests replace it.
var inUse = nbdkernel.InUse

// KeepDeviceIfBusy makes the server leave its kernel device connected when it stops
// (KeepDevice) if the device is in use, or if that cannot be told: for a server that a
// supervisor stops or restarts, which must not pull a mounted device from under its
// users.
func (s *Server) KeepDeviceIfBusy() {
	if s.devIndex < 0 {
		return
	}
	why, err := inUse(s.devIndex)
	if err == nil && why == "" {
		return
	}
	if err != nil {
		why = "cannot tell: " + err.Error()
	}
	s.log.Warn("the kernel device is in use: leaving it connected, as 'eli detach --keep-device' does, for a new server to re-plug",
		"device", s.cfg.Device, "in_use", why, "dead_conn_timeout_s", nbdkernel.DeadConnTimeout)
	s.KeepDevice()
}

// disconnect is nbdkernel.Disconnect; tests count its calls.
var disconnect = nbdkernel.Disconnect

func (s *Server) stopServing(ctx context.Context) {
	keep := s.keepDevice.Load()
	if s.devIndex >= 0 && keep {
		s.log.Info("leaving the kernel device connected for the next attach", "device", s.cfg.Device,
			"dead_conn_timeout_s", nbdkernel.DeadConnTimeout)
	} else if s.devIndex >= 0 {
		if err := disconnect(s.devIndex); err != nil {
			s.log.Warn("disconnect kernel device", "device", s.cfg.Device, "err", err)
		}
	}
	s.devIndex = -1
	if s.kdev != nil {
		s.kdev.Close()
		s.kdev = nil
	}
	s.closeListeners()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, srv := range s.servers {
		shutdown := srv.Shutdown
		if keep {
			shutdown = srv.Handover // the kernel resends what we leave unanswered
		}
		if err := shutdown(ctx); err != nil {
			s.log.Warn("shutdown", "err", err)
		}
	}
	s.servers = nil
}

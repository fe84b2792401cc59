package nbdclient

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

var (
	timeZero time.Time
	timePast = time.Unix(1, 0)
)

// DefaultPort is NBD's IANA-assigned TCP port.
const DefaultPort = "10809"

// Target is where an NBD export lives, as an NBD URI names it.
type Target struct {
	Network string // "tcp" or "unix"
	Address string // host:port, or the socket's path
	Export  string
	TLS     bool

	// TLS settings from the URI's query (libnbd's names): tls-certificates=DIR holds
	// ca-cert.pem and, for a client certificate, client-cert.pem and client-key.pem
	// (the layout nbdkit and qemu use); tls-verify-peer=false skips verifying the server;
	// tls-hostname overrides the name checked in the server's certificate.
	CertDir    string
	VerifyPeer bool
	Hostname   string
}

// IsURI reports whether s looks like an NBD URI (so that callers can tell a URI from a
// file path before parsing it).
func IsURI(s string) bool {
	for _, p := range []string{"nbd://", "nbds://", "nbd+unix://", "nbds+unix://"} {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// ParseURI reads an NBD URI as libnbd spells them (the NBD project's doc/uri.md):
//
//	nbd://host[:port][/export]
//	nbds://host[:port][/export]          (TLS required)
//	nbd+unix:///[export]?socket=PATH
//	nbds+unix:///[export]?socket=PATH    (TLS required)
//
// The export name is the path without its leading slash, percent-decoded. Query
// parameters other than socket, tls-certificates, tls-verify-peer and tls-hostname are
// refused, and so is anything else (another scheme, a user, a fragment).
func ParseURI(s string) (Target, error) {
	u, err := url.Parse(s)
	if err != nil {
		return Target{}, fmt.Errorf("NBD URI: %w", err)
	}
	t := Target{VerifyPeer: true}
	switch u.Scheme {
	case "nbd", "nbds":
		t.Network = "tcp"
	case "nbd+unix", "nbds+unix":
		t.Network = "unix"
	default:
		return Target{}, fmt.Errorf("NBD URI %q: scheme must be nbd, nbds, nbd+unix or nbds+unix", s)
	}
	t.TLS = strings.HasPrefix(u.Scheme, "nbds")
	if u.Opaque != "" {
		return Target{}, fmt.Errorf("NBD URI %q: expected %s://", s, u.Scheme)
	}
	if u.User != nil {
		return Target{}, fmt.Errorf("NBD URI %q: user names are not supported", s)
	}
	if u.Fragment != "" {
		return Target{}, fmt.Errorf("NBD URI %q: fragments are not allowed", s)
	}
	if u.Path != "" && !strings.HasPrefix(u.Path, "/") {
		return Target{}, fmt.Errorf("NBD URI %q: bad path", s)
	}
	t.Export = strings.TrimPrefix(u.Path, "/")
	if len(t.Export) > 4096 {
		return Target{}, fmt.Errorf("NBD URI: export name longer than 4096 bytes")
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return Target{}, fmt.Errorf("NBD URI %q: query: %w", s, err)
	}
	for k, v := range q {
		if len(v) != 1 {
			return Target{}, fmt.Errorf("NBD URI %q: %s given %d times", s, k, len(v))
		}
		val := v[0]
		switch k {
		case "socket":
			if t.Network != "unix" {
				return Target{}, fmt.Errorf("NBD URI %q: socket= is only for nbd+unix and nbds+unix", s)
			}
			t.Address = val
		case "tls-certificates":
			t.CertDir = val
		case "tls-verify-peer":
			b, err := strconv.ParseBool(val)
			if err != nil {
				return Target{}, fmt.Errorf("NBD URI %q: tls-verify-peer: %w", s, err)
			}
			t.VerifyPeer = b
		case "tls-hostname":
			t.Hostname = val
		default:
			return Target{}, fmt.Errorf("NBD URI %q: unsupported query parameter %q", s, k)
		}
		if !t.TLS && strings.HasPrefix(k, "tls-") {
			return Target{}, fmt.Errorf("NBD URI %q: %s needs nbds:// or nbds+unix://", s, k)
		}
	}
	switch t.Network {
	case "unix":
		if u.Host != "" {
			return Target{}, fmt.Errorf("NBD URI %q: %s:// takes no host (nbd+unix:///export?socket=PATH)", s, u.Scheme)
		}
		if t.Address == "" {
			return Target{}, fmt.Errorf("NBD URI %q: %s:// needs ?socket=PATH", s, u.Scheme)
		}
	case "tcp":
		host, port := u.Hostname(), u.Port()
		if host == "" {
			return Target{}, fmt.Errorf("NBD URI %q: no host", s)
		}
		if port == "" {
			if strings.HasSuffix(u.Host, ":") {
				return Target{}, fmt.Errorf("NBD URI %q: empty port", s)
			}
			port = DefaultPort
		}
		if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
			return Target{}, fmt.Errorf("NBD URI %q: bad port %q", s, port)
		}
		t.Address = net.JoinHostPort(host, port)
	}
	return t, nil
}

// String spells the target as a URI again (for messages; it holds no secrets).
func (t Target) String() string {
	scheme := "nbd"
	if t.TLS {
		scheme = "nbds"
	}
	u := url.URL{Path: "/" + t.Export}
	q := url.Values{}
	if t.Network == "unix" {
		u.Scheme = scheme + "+unix"
		q.Set("socket", t.Address)
	} else {
		u.Scheme, u.Host = scheme, t.Address
	}
	if t.CertDir != "" {
		q.Set("tls-certificates", t.CertDir)
	}
	if t.TLS && !t.VerifyPeer {
		q.Set("tls-verify-peer", "false")
	}
	if t.Hostname != "" {
		q.Set("tls-hostname", t.Hostname)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// tlsConfig builds the client's TLS settings from the target's: the CA and client
// certificate from CertDir when given (else the system's roots), the server name from
// tls-hostname, the URI's host, or "localhost" for a unix socket.
func (t Target) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	switch {
	case t.Hostname != "":
		cfg.ServerName = t.Hostname
	case t.Network == "tcp":
		host, _, err := net.SplitHostPort(t.Address)
		if err != nil {
			return nil, err
		}
		cfg.ServerName = host
	default:
		cfg.ServerName = "localhost"
	}
	cfg.InsecureSkipVerify = !t.VerifyPeer
	if t.CertDir == "" {
		return cfg, nil
	}
	ca, err := os.ReadFile(filepath.Join(t.CertDir, "ca-cert.pem"))
	switch {
	case err == nil:
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(ca) {
			return nil, fmt.Errorf("TLS: no certificate in %s", filepath.Join(t.CertDir, "ca-cert.pem"))
		}
		cfg.RootCAs = pool
	case !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("TLS: %w", err)
	}
	certFile, keyFile := filepath.Join(t.CertDir, "client-cert.pem"), filepath.Join(t.CertDir, "client-key.pem")
	if _, err := os.Stat(certFile); err == nil {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("TLS client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

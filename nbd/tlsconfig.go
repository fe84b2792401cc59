package nbd

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"time"
)

// TLSConfigFromFiles builds a server TLS config from PEM files: the server's certificate
// chain and key, and optionally a CA bundle. With a CA, every client must present a
// certificate that chains to it (tls.RequireAndVerifyClientCert); without one, clients are
// not asked for certificates. TLS 1.2 is the minimum, as proto.md ("TLS versions") asks.
// (Server serves such a config in a form GnuTLS clients can use over TLS 1.3: see
// gnutlsClientAuth.)
func TLSConfigFromFiles(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("nbd: load TLS certificate: %w", err)
	}
	cfg := &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS12,
	}
	if clientCAFile == "" {
		return cfg, nil
	}
	pem, err := os.ReadFile(clientCAFile)
	if err != nil {
		return nil, fmt.Errorf("nbd: read client CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, errors.New("nbd: client CA file holds no PEM certificate")
	}
	cfg.ClientCAs = pool
	cfg.ClientAuth = tls.RequireAndVerifyClientCert
	return cfg, nil
}

// gnutlsClientAuth returns cfg, or for a config that requires client certificates
// chaining to ClientCAs, a copy that checks the same thing without sending the CA names.
//
// Why: over TLS 1.3, a GnuTLS client (libnbd, qemu) that receives a CertificateRequest
// with certificate_authorities picks its certificate by matching the issuer against them
// and the key's algorithm against the public-key algorithms it derives from the request's
// signature_algorithms. It derives RSA-PSS, not RSA, from rsa_pss_rsae_*, and Go's TLS 1.3
// CertificateRequest lists no rsa_pkcs1_* scheme, so no RSA client certificate ever
// matches: the client sends an empty Certificate and the server fails with "client didn't
// provide a certificate". Without certificate_authorities, GnuTLS sends the one
// certificate it has. The chain is then verified here as crypto/tls would have: against
// the same roots, for client authentication.
func gnutlsClientAuth(cfg *tls.Config) *tls.Config {
	if cfg == nil || cfg.ClientCAs == nil || cfg.ClientAuth != tls.RequireAndVerifyClientCert {
		return cfg
	}
	roots := cfg.ClientCAs
	now := cfg.Time
	if now == nil {
		now = time.Now
	}
	next := cfg.VerifyConnection
	c := cfg.Clone()
	c.ClientCAs = nil
	c.ClientAuth = tls.RequireAnyClientCert
	c.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("tls: client didn't provide a certificate")
		}
		opts := x509.VerifyOptions{
			Roots:         roots,
			CurrentTime:   now(),
			Intermediates: x509.NewCertPool(),
			KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}
		for _, ic := range cs.PeerCertificates[1:] {
			opts.Intermediates.AddCert(ic)
		}
		if _, err := cs.PeerCertificates[0].Verify(opts); err != nil {
			return fmt.Errorf("tls: failed to verify client certificate: %w", err)
		}
		if next != nil {
			return next(cs)
		}
		return nil
	}
	return c
}

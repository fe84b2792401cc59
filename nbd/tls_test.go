package nbd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
	"github.com/elidisk/eli/internal/testtool"
)

// pki is a throwaway CA with a server and a client certificate, made in the test.
type pki struct {
	caPEM                       []byte
	serverCert                  tls.Certificate
	clientCertPEM, clientKeyPEM []byte
	clientCert                  tls.Certificate
	caPool                      *x509.CertPool
}

func newCA(t testing.TB, name string) (*x509.Certificate, *ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return cert, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func issue(t testing.TB, ca *x509.Certificate, caKey *ecdsa.PrivateKey, serial int64, cn string, usage x509.ExtKeyUsage) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
	if usage == x509.ExtKeyUsageServerAuth {
		tmpl.DNSNames = []string{"localhost"}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})
}

func newPKI(t testing.TB) *pki {
	t.Helper()
	ca, caKey, caPEM := newCA(t, "eli test CA")
	p := &pki{caPEM: caPEM, caPool: x509.NewCertPool()}
	p.caPool.AddCert(ca)
	sc, sk := issue(t, ca, caKey, 2, "localhost", x509.ExtKeyUsageServerAuth)
	var err error
	if p.serverCert, err = tls.X509KeyPair(sc, sk); err != nil {
		t.Fatal(err)
	}
	p.clientCertPEM, p.clientKeyPEM = issue(t, ca, caKey, 3, "eli test client", x509.ExtKeyUsageClientAuth)
	if p.clientCert, err = tls.X509KeyPair(p.clientCertPEM, p.clientKeyPEM); err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *pki) serverConfig(requireClient bool) *tls.Config {
	cfg := &tls.Config{Certificates: []tls.Certificate{p.serverCert}, MinVersion: tls.VersionTLS12}
	if requireClient {
		cfg.ClientCAs = p.caPool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg
}

// clientDir lays out certificates as libnbd (GnuTLS) expects for tls-certificates=DIR:
// ca-cert.pem, and optionally client-cert.pem and client-key.pem.
func (p *pki) clientDir(t testing.TB, withClientCert bool) string {
	t.Helper()
	dir := t.TempDir()
	files := map[string][]byte{"ca-cert.pem": p.caPEM}
	if withClientCert {
		files["client-cert.pem"] = p.clientCertPEM
		files["client-key.pem"] = p.clientKeyPEM
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// warnCounter counts warnings, to see refused TLS clients logged.
type warnCounter struct {
	slog.Handler
	warns *atomic.Int64
}

func (h warnCounter) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		h.warns.Add(1)
	}
	return h.Handler.Handle(ctx, r)
}

func (h warnCounter) WithAttrs(as []slog.Attr) slog.Handler {
	return warnCounter{h.Handler.WithAttrs(as), h.warns}
}

func TestTLSNbdinfo(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	p := newPKI(t)
	var warns atomic.Int64
	srv := oneExportServer(newMem(1<<20), nil)
	srv.TLSConfig = p.serverConfig(true)
	srv.Logger = slog.New(warnCounter{testLogger(t).Handler(), &warns})
	path := serveUnix(t, srv)

	good := p.clientDir(t, true)
	out := run(t, 30*time.Second, "nbdinfo", fmt.Sprintf("nbds+unix:///?socket=%s&tls-certificates=%s", path, good))
	if !strings.Contains(out, "with TLS") || !strings.Contains(out, "export-size: 1048576") {
		t.Fatalf("nbdinfo over TLS:\n%s", out)
	}
	out = run(t, 30*time.Second, "nbdinfo", "--list", fmt.Sprintf("nbds+unix:///?socket=%s&tls-certificates=%s", path, good))
	if !strings.Contains(out, "with TLS") {
		t.Fatalf("nbdinfo --list over TLS:\n%s", out)
	}

	before := warns.Load()
	tests := []struct{ name, uri string }{
		{"no client certificate", fmt.Sprintf("nbds+unix:///?socket=%s&tls-certificates=%s", path, p.clientDir(t, false))},
		{"client certificate from another CA", fmt.Sprintf("nbds+unix:///?socket=%s&tls-certificates=%s", path, newPKI(t).clientDir(t, true))},
		{"no TLS at all", uriFor(path, "")},
	}
	for _, tc := range tests {
		out, err := runErr(30*time.Second, "nbdinfo", tc.uri)
		if err == nil {
			t.Errorf("%s: nbdinfo succeeded:\n%s", tc.name, out)
		}
		if strings.Contains(out, "export-size") {
			t.Errorf("%s: export details leaked:\n%s", tc.name, out)
		}
	}
	// The two refused certificates are TLS failures, logged as warnings.
	deadline := time.Now().Add(5 * time.Second)
	for warns.Load()-before < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if w := warns.Load() - before; w < 2 {
		t.Errorf("%d warnings logged for refused TLS clients, want at least 2", w)
	}
}

func TestTLSOverTCP(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	p := newPKI(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no TCP loopback: %v", err)
	}
	srv := oneExportServer(newMem(1<<20), nil)
	srv.TLSConfig = p.serverConfig(true)
	srv.Logger = testLogger(t)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		<-served
	})
	uri := fmt.Sprintf("nbds://%s/?tls-certificates=%s", l.Addr(), p.clientDir(t, true))
	out := run(t, 30*time.Second, "nbdinfo", uri)
	if !strings.Contains(out, "with TLS") {
		t.Fatalf("nbdinfo over TCP+TLS:\n%s", out)
	}
}

// TestForcedTLS drives FORCEDTLS by hand: before STARTTLS every option but STARTTLS and
// ABORT is refused with NBD_REP_ERR_TLS_REQD and EXPORT_NAME ends the session; after it,
// the session works over TLS and a second STARTTLS is invalid.
func TestForcedTLS(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	srv := oneExportServer(newMem(1<<20), nil)
	srv.TLSConfig = p.serverConfig(true)
	path := serveUnix(t, srv)

	rc := dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle | nbdproto.FlagCNoZeroes)
	for _, o := range []struct {
		opt  uint32
		data []byte
	}{
		{nbdproto.OptList, nil}, {nbdproto.OptInfo, goData("")}, {nbdproto.OptGo, goData("")}, {nbdproto.OptStructuredReply, nil},
		{nbdproto.OptSetMetaContext, nil}, {999, []byte("x")},
	} {
		rc.sendOpt(o.opt, o.data)
		r, err := rc.readOptReply()
		if err != nil || r.typ != nbdproto.RepErrTLSReqd {
			t.Fatalf("option %d before TLS: %+v %v, want NBD_REP_ERR_TLS_REQD", o.opt, r, err)
		}
	}
	rc.sendOpt(nbdproto.OptStartTLS, []byte{1})
	if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepErrInvalid {
		t.Fatalf("STARTTLS with data: %+v %v", r, err)
	}
	rc.sendOpt(nbdproto.OptStartTLS, nil)
	if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepAck {
		t.Fatalf("STARTTLS: %+v %v", r, err)
	}
	tc := tls.Client(rc.c, &tls.Config{RootCAs: p.caPool, ServerName: "localhost", Certificates: []tls.Certificate{p.clientCert}})
	if err := tc.Handshake(); err != nil {
		t.Fatalf("TLS handshake: %v", err)
	}
	rc.c = tc
	rc.sendOpt(nbdproto.OptStartTLS, nil)
	if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepErrInvalid {
		t.Fatalf("second STARTTLS: %+v %v", r, err)
	}
	rc.sendOpt(nbdproto.OptStructuredReply, nil)
	if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepAck {
		t.Fatalf("structured reply over TLS: %+v %v", r, err)
	}
	rc.structured = true
	rc.sendOpt(nbdproto.OptGo, goData(""))
	rs, err := rc.readOptReplies()
	if err != nil {
		t.Fatal(err)
	}
	if info, err := parseInfos(rs); err != nil || info.size != 1<<20 {
		t.Fatalf("GO over TLS: %+v %v", info, err)
	}
	data := pattern(65536, 5)
	if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 0, 65536, data); r.err != 0 {
		t.Fatalf("write over TLS: %d", r.err)
	}
	r := rc.roundTrip(t, nbdproto.CmdRead, 0, 0, 65536, nil)
	mustEqual(t, "read over TLS", r.data, data)
	rc.send(nbdproto.CmdDisc, 0, 0, 0, 0, nil)
	if _, err := rc.c.Read(make([]byte, 1)); err == nil {
		t.Fatal("server sent data after DISC")
	}

	// EXPORT_NAME before TLS cannot be refused with a reply: the session ends.
	rc = dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle)
	rc.sendOpt(nbdproto.OptExportName, nil)
	rc.expectClosed(t)

	// ABORT before TLS is allowed.
	rc = dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle)
	rc.sendOpt(nbdproto.OptAbort, nil)
	if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepAck {
		t.Fatalf("ABORT before TLS: %+v %v", r, err)
	}
	rc.expectClosed(t)

	// A Go client without a certificate fails the TLS handshake.
	rc = dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle)
	rc.sendOpt(nbdproto.OptStartTLS, nil)
	if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepAck {
		t.Fatalf("STARTTLS: %+v %v", r, err)
	}
	tc = tls.Client(rc.c, &tls.Config{RootCAs: p.caPool, ServerName: "localhost"})
	err = tc.Handshake()
	if err == nil {
		// With TLS 1.3 the client learns of the refusal on its first read.
		tc.Write(optBytes(nbdproto.OptList, nil))
		_, err = tc.Read(make([]byte, 1))
	}
	if err == nil {
		t.Fatal("server accepted a client without a certificate")
	}
}

func TestTLSConfigFromFiles(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	dir := t.TempDir()
	ca, caKey, _ := newCA(t, "x")
	sc, sk := issue(t, ca, caKey, 9, "localhost", x509.ExtKeyUsageServerAuth)
	write := func(name string, b []byte) string {
		f := filepath.Join(dir, name)
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return f
	}
	cert, key, caf := write("cert.pem", sc), write("key.pem", sk), write("ca.pem", p.caPEM)
	cfg, err := TLSConfigFromFiles(cert, key, "")
	if err != nil || cfg.ClientAuth != tls.NoClientCert || cfg.MinVersion != tls.VersionTLS12 {
		t.Fatalf("without CA: %+v %v", cfg, err)
	}
	cfg, err = TLSConfigFromFiles(cert, key, caf)
	if err != nil || cfg.ClientAuth != tls.RequireAndVerifyClientCert || cfg.ClientCAs == nil {
		t.Fatalf("with CA: %v", err)
	}
	if _, err := TLSConfigFromFiles(cert, key, write("bad.pem", []byte("nope"))); err == nil {
		t.Error("accepted a CA file without certificates")
	}
	if _, err := TLSConfigFromFiles(cert, caf, ""); err == nil {
		t.Error("accepted a certificate as its own key")
	}
	var pe *os.PathError
	if _, err := TLSConfigFromFiles(cert, key, filepath.Join(dir, "missing")); !errors.As(err, &pe) {
		t.Errorf("missing CA file: %v", err)
	}
}

// rsaPKI writes a CA, a server and a client certificate with RSA keys (what certtool and
// the qemu and libnbd documentation make) into dir, under the names TLSConfigFromFiles'
// caller and the GnuTLS clients expect: ca-cert.pem, server-{cert,key}.pem and
// client-{cert,key}.pem.
func rsaPKI(t *testing.T, dir string) {
	t.Helper()
	gen := func() *rsa.PrivateKey {
		k, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	write := func(name, typ string, der []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	caKey := gen()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "eli test RSA CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	write("ca-cert.pem", "CERTIFICATE", caDER)
	for i, role := range []string{"server", "client"} {
		key := gen()
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(int64(2 + i)), Subject: pkix.Name{CommonName: "eli test " + role},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}
		if role == "server" {
			tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
			tmpl.DNSNames = []string{"localhost"}
			tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		write(role+"-cert.pem", "CERTIFICATE", der)
		write(role+"-key.pem", "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(key))
	}
}

// TestTLS13ClientCertGnuTLS: with a client CA, GnuTLS clients (nbdinfo, qemu-img) must be
// able to authenticate with an RSA certificate over TLS 1.3. They could not while the
// server's CertificateRequest named the CA (see gnutlsClientAuth); the server logged
// "client didn't provide a certificate". A client without a certificate, or with one from
// another CA, is still refused.
func TestTLS13ClientCertGnuTLS(t *testing.T) {
	t.Parallel()
	testtool.Need(t, "nbdinfo", "libnbd-bin")
	testtool.Need(t, "qemu-img", "qemu-utils")
	dir := t.TempDir()
	rsaPKI(t, dir)
	cfg, err := TLSConfigFromFiles(filepath.Join(dir, "server-cert.pem"), filepath.Join(dir, "server-key.pem"), filepath.Join(dir, "ca-cert.pem"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MinVersion = tls.VersionTLS13 // the case that failed; 1.2 always worked
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := oneExportServer(newMem(1<<20), func(e *Export) { e.Name = "disk.eli" })
	srv.TLSConfig = cfg
	srv.Logger = testLogger(t)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		<-served
	})
	port := l.Addr().(*net.TCPAddr).Port

	out := run(t, 30*time.Second, "nbdinfo", fmt.Sprintf("nbds://localhost:%d/disk.eli?tls-certificates=%s", port, dir))
	if !strings.Contains(out, "with TLS") || !strings.Contains(out, "export-size: 1048576") {
		t.Fatalf("nbdinfo over TLS 1.3:\n%s", out)
	}
	out = run(t, 30*time.Second, "qemu-img", "info", "--output=json",
		"--object", "tls-creds-x509,id=tls0,endpoint=client,dir="+dir,
		"--image-opts", fmt.Sprintf("driver=nbd,host=127.0.0.1,port=%d,export=disk.eli,tls-creds=tls0", port))
	if !strings.Contains(out, `"virtual-size": 1048576`) {
		t.Fatalf("qemu-img info over TLS 1.3:\n%s", out)
	}

	// Refused: no client certificate, and one from another CA.
	noCert := t.TempDir()
	other := t.TempDir()
	rsaPKI(t, other)
	ca, _ := os.ReadFile(filepath.Join(dir, "ca-cert.pem"))
	for _, d := range []string{noCert, other} {
		if err := os.WriteFile(filepath.Join(d, "ca-cert.pem"), ca, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for name, d := range map[string]string{"no client certificate": noCert, "client certificate from another CA": other} {
		out, err := runErr(30*time.Second, "nbdinfo", fmt.Sprintf("nbds://localhost:%d/disk.eli?tls-certificates=%s", port, d))
		if err == nil || strings.Contains(out, "export-size") {
			t.Errorf("%s: nbdinfo was let in:\n%s", name, out)
		}
	}
}

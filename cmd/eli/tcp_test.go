package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/elidisk/eli/nbdclient"
)

// listenAddr finds the "listening on ADDR (...)" line attach prints.
func listenAddr(t *testing.T, stdout string) string {
	t.Helper()
	for _, line := range strings.Split(stdout, "\n") {
		if rest, ok := strings.CutPrefix(line, "listening on "); ok {
			return strings.Fields(rest)[0]
		}
	}
	t.Fatalf("attach did not say where it listens:\n%s", stdout)
	return ""
}

// TestListenTCP: --listen with --insecure-tcp serves the volume over TCP (on the port the
// system picked for :0, which attach reports), and the unix URI is still the last line.
func TestListenTCP(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("tcp.img", "16M")
	r := e.OK("attach", "--passphrase-file", e.Pass, "--listen", "127.0.0.1:0", "--insecure-tcp", img)
	addr := listenAddr(t, r.Stdout)
	if _, port, _ := net.SplitHostPort(addr); port == "0" || port == "" {
		t.Fatalf("attach reports %q, not the port it got", addr)
	}
	if !strings.Contains(r.Stdout, "(no TLS)") {
		t.Errorf("plain TCP is not called out: %s", r.Stdout)
	}
	lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
	if !strings.HasPrefix(lines[len(lines)-1], "nbd+unix://") {
		t.Errorf("the last line is not the unix URI: %s", r.Stdout)
	}
	c, err := nbdclient.Dial("tcp", addr, "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	data := []byte("over tcp")
	if err := c.WriteAt(data, 0, true); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if err := c.ReadAt(got, 0); err != nil || string(got) != string(data) {
		t.Fatalf("read back %q, %v", got, err)
	}
}

// TestListenTLS: with a certificate, the TCP listener refuses a client that does not
// start TLS, and the unix socket (local, 0600) still serves without it.
func TestListenTLS(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cert, key := selfSigned(t, e)
	img := e.initVolume("tls.img", "16M")
	r := e.OK("attach", "--passphrase-file", e.Pass, "--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key, img)
	if !strings.Contains(r.Stdout, "(TLS)") {
		t.Errorf("TLS is not reported: %s", r.Stdout)
	}
	addr := listenAddr(t, r.Stdout)
	if _, err := nbdclient.Dial("tcp", addr, ""); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("a plain client got past a TLS listener: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
	c := dial(t, strings.TrimPrefix(lines[len(lines)-1], "nbd+unix:///?socket="))
	if c.Export.Size == 0 {
		t.Fatal("unix socket export has no size")
	}
	e.FailsCode(2, "--tls-cert and --tls-key go together", "attach", "--passphrase-file", e.Pass, "--listen", "127.0.0.1:0", "--tls-cert", cert, img)
}

// selfSigned writes a throwaway server certificate and key for 127.0.0.1.
func selfSigned(t *testing.T, e *env) (certFile, keyFile string) {
	t.Helper()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "eli test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &priv.PublicKey, priv)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = e.Path("srv.pem"), e.Path("srv.key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

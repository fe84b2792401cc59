package nbdclient

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

// pki makes, with openssl, a CA and a server and a client certificate signed by it, laid
// out as nbdkit and qemu (server) and libnbd (client) read a certificates directory.
func pki(t *testing.T, dir string) (serverDir, clientDir string) {
	t.Helper()
	openssl := testtool.Need(t, "openssl", "openssl")
	run := func(args ...string) {
		t.Helper()
		cmd := exec.Command(openssl, args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("openssl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	key := func(name string) {
		run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name)
	}
	key("ca-key.pem")
	run("req", "-x509", "-new", "-key", "ca-key.pem", "-out", "ca-cert.pem", "-days", "2", "-subj", "/CN=eli test CA",
		"-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
	sign := func(name, ext string) {
		key(name + "-key.pem")
		run("req", "-new", "-key", name+"-key.pem", "-out", name+".csr", "-subj", "/CN=eli test "+name)
		if err := os.WriteFile(filepath.Join(dir, name+".ext"), []byte(ext), 0o600); err != nil {
			t.Fatal(err)
		}
		run("x509", "-req", "-in", name+".csr", "-CA", "ca-cert.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
			"-out", name+"-cert.pem", "-days", "2", "-extfile", name+".ext")
	}
	sign("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
	sign("client", "extendedKeyUsage=clientAuth\n")
	serverDir, clientDir = filepath.Join(dir, "server"), filepath.Join(dir, "client")
	for d, files := range map[string][]string{
		serverDir: {"ca-cert.pem", "server-cert.pem", "server-key.pem"},
		clientDir: {"ca-cert.pem", "client-cert.pem", "client-key.pem"},
	} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			b, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(d, f), b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	return serverDir, clientDir
}

func TestTLS(t *testing.T) {
	t.Parallel()
	serverDir, clientDir := pki(t, t.TempDir())
	_, otherClient := pki(t, t.TempDir()) // a CA the server does not know
	tlsArgs := []string{"--tls=require", "--tls-certificates=" + serverDir, "--tls-verify-peer"}
	tcp := nbdkit(t, "tcp", tlsArgs, "memory", "8M")
	unix := nbdkit(t, "unix", tlsArgs, "memory", "8M")
	tcpURI := strings.Replace(tcp.uri, "nbd://", "nbds://", 1)
	unixURI := strings.Replace(unix.uri, "nbd+unix://", "nbds+unix://", 1)

	t.Run("tcp", func(t *testing.T) {
		t.Parallel()
		exercise(t, open(t, tcpURI+"?tls-certificates="+clientDir, nil))
	})
	t.Run("unix", func(t *testing.T) {
		t.Parallel()
		exercise(t, open(t, unixURI+"&tls-certificates="+clientDir, nil))
	})
	t.Run("qemu-nbd", func(t *testing.T) {
		t.Parallel()
		q := qemuNBD(t, "tcp", image(t, 8<<20),
			"--object", "tls-creds-x509,id=tls0,endpoint=server,verify-peer=on,dir="+serverDir, "--tls-creds=tls0")
		exercise(t, open(t, strings.Replace(q.uri, "nbd://", "nbds://", 1)+"?tls-certificates="+clientDir, nil))
	})
	refused := []struct {
		name, uri, err string
	}{
		{"plaintext", tcp.uri, "TLS required"},
		{"unknown-server-CA", tcpURI + "?tls-certificates=" + otherClient, "certificate"},
		{"wrong-hostname", tcpURI + "?tls-certificates=" + clientDir + "&tls-hostname=storage.example", "certificate"},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r, err := Open(tc.uri, nil)
			if err == nil {
				r.Close()
				t.Fatalf("%s: connected", tc.uri)
			}
			if !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("%s: %v; want an error about %q", tc.uri, err, tc.err)
			}
		})
	}
	t.Run("no-client-certificate", func(t *testing.T) {
		t.Parallel()
		// Trust the server, but have no certificate to show it: --tls-verify-peer refuses.
		dir := t.TempDir()
		ca, err := os.ReadFile(filepath.Join(clientDir, "ca-cert.pem"))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "ca-cert.pem"), ca, 0o600); err != nil {
			t.Fatal(err)
		}
		r, err := Open(tcpURI+"?tls-certificates="+dir, &Options{DialTimeout: 10e9})
		if err == nil {
			// TLS 1.3 reports the server's refusal of the client only on the first read.
			_, err = r.ReadAt(make([]byte, 512), 0)
			r.Close()
		}
		if err == nil {
			t.Fatal("served a client without a certificate")
		}
	})
}

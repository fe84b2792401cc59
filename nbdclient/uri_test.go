package nbdclient

import (
	"strings"
	"testing"
)

func TestParseURI(t *testing.T) {
	t.Parallel()
	tests := []struct {
		uri  string
		want Target // zero Network: an error is expected, containing errSub
		err  string
	}{
		{uri: "nbd://example.com/disk", want: Target{Network: "tcp", Address: "example.com:10809", Export: "disk", VerifyPeer: true}},
		{uri: "nbd://example.com", want: Target{Network: "tcp", Address: "example.com:10809", VerifyPeer: true}},
		{uri: "nbd://example.com:1234/", want: Target{Network: "tcp", Address: "example.com:1234", VerifyPeer: true}},
		{uri: "nbd://[::1]:99/a%20b/c", want: Target{Network: "tcp", Address: "[::1]:99", Export: "a b/c", VerifyPeer: true}},
		{uri: "nbds://h/e?tls-certificates=/etc/pki/nbd", want: Target{Network: "tcp", Address: "h:10809", Export: "e", TLS: true, CertDir: "/etc/pki/nbd", VerifyPeer: true}},
		{uri: "nbds://h/e?tls-verify-peer=false&tls-hostname=storage", want: Target{Network: "tcp", Address: "h:10809", Export: "e", TLS: true, Hostname: "storage"}},
		{uri: "nbd+unix:///vol?socket=/run/nbd.sock", want: Target{Network: "unix", Address: "/run/nbd.sock", Export: "vol", VerifyPeer: true}},
		{uri: "nbd+unix://?socket=/s", want: Target{Network: "unix", Address: "/s", VerifyPeer: true}},
		{uri: "nbds+unix:///?socket=/s&tls-certificates=/c", want: Target{Network: "unix", Address: "/s", TLS: true, CertDir: "/c", VerifyPeer: true}},

		{uri: "http://h/e", err: "scheme"},
		{uri: "/dev/sda", err: "scheme"},
		{uri: "nbd:h/e", err: "expected nbd://"},
		{uri: "nbd:///e", err: "no host"},
		{uri: "nbd://h:/e", err: "empty port"},
		{uri: "nbd://h:0/e", err: "bad port"},
		{uri: "nbd://h:70000/e", err: "bad port"},
		{uri: "nbd://user@h/e", err: "user"},
		{uri: "nbd://h/e#frag", err: "fragment"},
		{uri: "nbd://h/e?socket=/s", err: "socket= is only"},
		{uri: "nbd://h/e?tls-certificates=/c", err: "needs nbds"},
		{uri: "nbd://h/e?bogus=1", err: "unsupported query parameter"},
		{uri: "nbds://h/e?tls-verify-peer=maybe", err: "tls-verify-peer"},
		{uri: "nbd+unix:///e", err: "needs ?socket"},
		{uri: "nbd+unix://host/e?socket=/s", err: "takes no host"},
		{uri: "nbd+unix:///e?socket=/a&socket=/b", err: "given 2 times"},
		{uri: "nbd://h/" + strings.Repeat("x", 4097), err: "longer than 4096"},
	}
	for _, tc := range tests {
		got, err := ParseURI(tc.uri)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseURI(%q) = %+v, %v; want an error with %q", tc.uri, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseURI(%q) = %+v, %v; want %+v", tc.uri, got, err, tc.want)
			continue
		}
		// String spells it back as a URI that parses to the same target.
		again, err := ParseURI(got.String())
		if err != nil || again != got {
			t.Errorf("ParseURI(%q.String() = %q) = %+v, %v", tc.uri, got.String(), again, err)
		}
		if !IsURI(tc.uri) {
			t.Errorf("IsURI(%q) = false", tc.uri)
		}
	}
	if IsURI("/var/lib/eli/vol.img") {
		t.Error("IsURI took a path for a URI")
	}
}

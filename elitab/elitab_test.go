package elitab

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func parseOne(t *testing.T, line string) (Volume, *LineError) {
	t.Helper()
	vols, errs, err := Parse("/etc/elitab", strings.NewReader(line+"\n"))
	if err != nil {
		t.Fatalf("%q: %v", line, err)
	}
	if len(vols)+len(errs) != 1 {
		t.Fatalf("%q: %d volumes and %d errors, want one of either", line, len(vols), len(errs))
	}
	if len(errs) == 1 {
		return Volume{}, errs[0]
	}
	return vols[0], nil
}

// base is what a line with only a name and a provider gives.
func base(name, provider string) Volume {
	return Volume{Line: 1, Name: name, Provider: provider, KeySlot: -1, Timeout: DefaultTimeout, Tries: DefaultTries, Device: DeviceAuto}
}

func TestParseOptions(t *testing.T) {
	t.Parallel()
	with := func(f func(*Volume)) Volume {
		v := base("data", "/dev/sdb1")
		f(&v)
		return v
	}
	for _, tc := range []struct {
		line string
		want Volume
	}{
		{"data /dev/sdb1", base("data", "/dev/sdb1")},
		{"data /dev/sdb1 -", base("data", "/dev/sdb1")},
		{"data /dev/sdb1 none none", base("data", "/dev/sdb1")},
		{"data /dev/sdb1 - defaults", base("data", "/dev/sdb1")},
		{"data /dev/sdb1 - -", base("data", "/dev/sdb1")},
		{"  data\t/dev/sdb1   -  ", base("data", "/dev/sdb1")},
		{"data /dev/disk/by-id/../sdb1", base("data", "/dev/disk/sdb1")},
		{"data /dev/sdb1 /etc/eli/data.key", with(func(v *Volume) { v.Key = Key{Kind: KeyFile, Path: "/etc/eli/data.key"} })},
		{`data /dev/sdb1 /etc/eli/my\040key`, with(func(v *Volume) { v.Key = Key{Kind: KeyFile, Path: "/etc/eli/my key"} })},
		{"data /dev/sdb1 cred:data.key", with(func(v *Volume) { v.Key = Key{Kind: KeyCredential, Credential: "data.key"} })},
		{"data /dev/sdb1 cred:data.key:/etc/eli/k", with(func(v *Volume) { v.Key = Key{Kind: KeyCredential, Credential: "data.key", Path: "/etc/eli/k"} })},
		{"data /dev/sdb1 cred-encrypted:data", with(func(v *Volume) { v.Key = Key{Kind: KeyEncryptedCredential, Credential: "data"} })},
		{"data /dev/sdb1 cred-encrypted:data:/var/lib/c/data.cred", with(func(v *Volume) {
			v.Key = Key{Kind: KeyEncryptedCredential, Credential: "data", Path: "/var/lib/c/data.cred"}
		})},
		{"data /dev/sdb1 /etc/eli/data.jwe keyscript=/usr/local/sbin/unlock", with(func(v *Volume) {
			v.Key = Key{Kind: KeyCommand, Command: []string{"/usr/local/sbin/unlock", "/etc/eli/data.jwe"}}
		})},
		{"data /dev/sdb1 none keyscript=/usr/local/sbin/unlock", with(func(v *Volume) {
			v.Key = Key{Kind: KeyCommand, Command: []string{"/usr/local/sbin/unlock"}}
		})},
		{"data /dev/sdb1 tang-volume keyscript=/usr/local/sbin/unlock", with(func(v *Volume) {
			v.Key = Key{Kind: KeyCommand, Command: []string{"/usr/local/sbin/unlock", "tang-volume"}}
		})},
		{"data /dev/sdb1 - _netdev", with(func(v *Volume) { v.NetDev = true })},
		{"data /dev/sdb1 - noauto", with(func(v *Volume) { v.NoAuto = true })},
		{"data /dev/sdb1 - auto,nofail", with(func(v *Volume) { v.NoFail = true })},
		{"data /dev/sdb1 - nofail,fail", base("data", "/dev/sdb1")},
		{"data /dev/sdb1 - readonly", with(func(v *Volume) { v.ReadOnly = true })},
		{"data /dev/sdb1 - read-only", with(func(v *Volume) { v.ReadOnly = true })},
		{"data /dev/sdb1 - timeout=30", with(func(v *Volume) { v.Timeout = 30 * time.Second })},
		{"data /dev/sdb1 - timeout=5min", with(func(v *Volume) { v.Timeout = 5 * time.Minute })},
		{`data /dev/sdb1 - timeout=1h\04030min`, with(func(v *Volume) { v.Timeout = 90 * time.Minute })},
		{"data /dev/sdb1 - timeout=1500ms", with(func(v *Volume) { v.Timeout = 1500 * time.Millisecond })},
		{"data /dev/sdb1 - tries=1", with(func(v *Volume) { v.Tries = 1 })},
		{"data /dev/sdb1 - device=none", with(func(v *Volume) { v.Device = "" })},
		{"data /dev/sdb1 - device=auto,connections=2", with(func(v *Volume) { v.Connections = 2 })},
		{"data /dev/sdb1 - device=/dev/nbd7", with(func(v *Volume) { v.Device = "/dev/nbd7" })},
		{"data /dev/sdb1 - witness=/var/lib/w/data", with(func(v *Volume) { v.Witness = "/var/lib/w/data" })},
		{"data /dev/sdb1 - key-slot=0", with(func(v *Volume) { v.KeySlot = 0 })},
		{"data /dev/sdb1 - key-slot=7", with(func(v *Volume) { v.KeySlot = 7 })},
		{"data /dev/sdb1 - x-systemd.requires=nbd.service,x-systemd.requires=b.socket,x-systemd.after=a.mount,x-systemd.before=z.target",
			with(func(v *Volume) {
				v.Requires, v.After, v.Before = []string{"nbd.service", "b.socket"}, []string{"a.mount"}, []string{"z.target"}
			})},
		{"data /dev/sdb1 - x-systemd.requires-mounts-for=/srv/keys/", with(func(v *Volume) { v.RequiresMountsFor = []string{"/srv/keys"} })},
		{"img /srv/disk.img", base("img", "/srv/disk.img")},
		{"r nbd://storage:10809/vol1 - _netdev", func() Volume {
			v := base("r", "nbd://storage:10809/vol1")
			v.Remote, v.NetDev = true, true
			return v
		}()},
		{"r nbds://storage/vol1?tls-certificates=/etc/eli/tls", func() Volume {
			v := base("r", "nbds://storage:10809/vol1?tls-certificates=%2Fetc%2Feli%2Ftls")
			v.Remote = true
			return v
		}()},
		{"r nbds://storage/vol1 - tls-certificates=/etc/eli/tls,tls-hostname=st.example,tls-verify-peer=no", func() Volume {
			v := base("r", "nbds://storage:10809/vol1?tls-certificates=%2Fetc%2Feli%2Ftls&tls-hostname=st.example&tls-verify-peer=false")
			v.Remote = true
			return v
		}()},
		{"r nbds+unix:///vol1?socket=/run/nbd.sock - tls-verify-peer=yes", func() Volume {
			v := base("r", "nbds+unix:///vol1?socket=%2Frun%2Fnbd.sock")
			v.Remote = true
			return v
		}()},
	} {
		got, err := parseOne(t, tc.line)
		if err != nil {
			t.Errorf("%q: %v", tc.line, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%q:\n got %+v\nwant %+v", tc.line, got, tc.want)
		}
	}
}

func TestParseMalformed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ line, want string }{
		{"data", `/etc/elitab:1: 1 fields; a line is NAME PROVIDER [KEY [OPTIONS]]; this line is skipped`},
		{"data /dev/sdb1 - nofail extra", `/etc/elitab:1: 5 fields`},
		{".data /dev/sdb1", `/etc/elitab:1: name: invalid name ".data"`},
		{"da/ta /dev/sdb1", `/etc/elitab:1: name: invalid name "da/ta"`},
		{"data sdb1", `/etc/elitab:1: provider: "sdb1" is neither an absolute path nor an NBD URI`},
		{"data nbd://h/e?x=1", `/etc/elitab:1: provider: NBD URI "nbd://h/e?x=1": unsupported query parameter "x"`},
		{"data nbd://h/e - tls-certificates=/etc/t", `/etc/elitab:1: options: the TLS options apply to an nbds:// or nbds+unix:// provider; nbd://h/e does not use TLS`},
		{"data /dev/sdb1 - tls-hostname=x", `/etc/elitab:1: options: the TLS options (tls-certificates=, tls-hostname=, tls-verify-peer=) apply to an nbds:// or nbds+unix:// provider, not to /dev/sdb1`},
		{"data nbds://h/e?tls-certificates=/a - tls-certificates=/b", `/etc/elitab:1: options: tls-certificates=: the provider's URI already says tls-certificates=/a`},
		{"data nbds://h/e?tls-hostname=a - tls-hostname=b", `/etc/elitab:1: options: tls-hostname=: the provider's URI already says tls-hostname=a`},
		{"data nbds://h/e - tls-certificates=etc/t", `options: tls-certificates=: "etc/t" is not an absolute path`},
		{"data nbds://h/e - tls-verify-peer=maybe", `options: tls-verify-peer=: "maybe" is not yes or no`},
		{"data nbds://h/e - tls-hostname=", `options: tls-hostname=: needs a value (tls-hostname=...)`},
		{"data /dev/sdb1 keys/data", `/etc/elitab:1: key: "keys/data" is none of: - or none (ask for a passphrase), an absolute keyfile path, cred:ID[:PATH], cred-encrypted:ID[:PATH]`},
		{"data /dev/sdb1 cred:", `/etc/elitab:1: key: "": a credential ID is 1 to 255 letters`},
		{"data /dev/sdb1 cred:.x", `key: ".x": a credential ID`},
		{"data /dev/sdb1 cred:a/b", `key: "a/b": a credential ID`},
		{"data /dev/sdb1 cred-encrypted:x:rel/path", `key: "rel/path": the credential's file must be an absolute path`},
		{`data /dev/sdb1 /etc/a\04`, `key: "/etc/a\\04": a backslash starts an octal escape such as \040 (a space)`},
		{`data /dev/sdb1 /etc/a\09x`, `key: "/etc/a\\09x": "\\09x" is not an octal escape`},
		{`data /dev/sdb1 /etc/a\000`, `key: "/etc/a\\000": "\\000" is not an octal escape`},
		{"data /dev/sdb1 - nofial", `/etc/elitab:1: options: unknown option "nofial" (elitab(5) lists them)`},
		{"data /dev/sdb1 - nofail,,noauto", `options: an empty option (two commas, or a comma at an end)`},
		{"data /dev/sdb1 - nofail,", `options: an empty option`},
		{"data /dev/sdb1 - nofail=yes", `options: nofail=: takes no value`},
		{"data /dev/sdb1 - _netdev=1", `options: _netdev=: takes no value`},
		{"data /dev/sdb1 - noauto,noauto", `options: noauto: given twice`},
		{"data /dev/sdb1 - readonly,read-only", `options: read-only: given twice`},
		{"data /dev/sdb1 - timeout", `options: timeout: needs a value (timeout=...)`},
		{"data /dev/sdb1 - timeout=soon", `options: timeout=: "soon" is not a time span`},
		{"data /dev/sdb1 - timeout=0", `options: timeout=: "0": a timeout must be positive (nothing waits forever)`},
		{"data /dev/sdb1 - timeout=5days", `options: timeout=: "5days": unknown unit "days"`},
		{"data /dev/sdb1 - timeout=25h", `options: timeout=: "25h" is longer than 24h0m0s`},
		{"data /dev/sdb1 - timeout=1234567890", `options: timeout=: "1234567890" is not a time span`},
		{"data /dev/sdb1 - tries=0", `options: tries=: "0" is not a number from 1 to 100`},
		{"data /dev/sdb1 - tries", `options: tries: needs a number`},
		{"data /dev/sdb1 - connections=65", `options: connections=: "65" is not a number from 1 to 64`},
		{"data /dev/sdb1 - device=none,connections=2", `options: connections=: applies to a kernel device, and this line has device=none`},
		{"data /dev/sdb1 - key-slot=8", `options: key-slot=: "8" is not a number from 0 to 7`},
		{"data /dev/sdb1 - key-slot=x", `options: key-slot=: "x" is not a number from 0 to 7`},
		{"data /dev/sdb1 - device=/dev/sda", `options: device=: "/dev/sda" is none of: auto, none, /dev/nbdN`},
		{"data /dev/sdb1 - device=", `options: device=: needs a value (device=...)`},
		{"data /dev/sdb1 - witness=w", `options: witness=: "w" is not an absolute path`},
		{"data /dev/sdb1 - keyscript=clevis", `options: keyscript=: "clevis" is not an absolute path (eli runs it without a shell or a search path)`},
		{"data /dev/sdb1 - x-systemd.requires=nbd", `options: x-systemd.requires=: "nbd" is not a unit name`},
		{"data /dev/sdb1 - x-systemd.after=a/b.service", `options: x-systemd.after=: "a/b.service" is not a unit name`},
		{"data /dev/sdb1 - x-systemd.requires-mounts-for=srv", `options: x-systemd.requires-mounts-for=: "srv" is not an absolute path`},
		{"data /dev/sdb1 - x-systemd.device-timeout=5", `options: unknown option "x-systemd.device-timeout=5"`},
	} {
		_, err := parseOne(t, tc.line)
		if err == nil {
			t.Errorf("%q parsed", tc.line)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, tc.want) || !strings.HasSuffix(msg, "; this line is skipped") ||
			!strings.HasPrefix(msg, "/etc/elitab:1:") {
			t.Errorf("%q:\n got %s\nwant it to contain %s", tc.line, msg, tc.want)
		}
	}
}

// TestParseKeepsGoodLines: a bad line is reported with its number and skipped; the
// lines around it still count, and names and devices stay unique.
func TestParseKeepsGoodLines(t *testing.T) {
	t.Parallel()
	table := `# name provider key options

a /dev/sdb1 /etc/eli/a.key device=/dev/nbd1
	# an indented comment
b /dev/sdc1 - nofial
c /srv/c.img cred:c
a /dev/sdd1
d /dev/sde1 - device=/dev/nbd1
e /dev/sdf1 - device=/dev/nbd2
`
	vols, errs, err := Parse("tab", strings.NewReader(table))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	var lines []int
	for _, v := range vols {
		names, lines = append(names, v.Name), append(lines, v.Line)
	}
	if !reflect.DeepEqual(names, []string{"a", "c", "e"}) || !reflect.DeepEqual(lines, []int{3, 6, 9}) {
		t.Errorf("volumes %v on lines %v; want a, c, e on 3, 6, 9", names, lines)
	}
	var msgs []string
	for _, e := range errs {
		msgs = append(msgs, e.Error())
	}
	want := []string{
		`tab:5: options: unknown option "nofial" (elitab(5) lists them); this line is skipped`,
		`tab:7: name: "a" is already the name of line 3; this line is skipped`,
		`tab:8: options: device=: /dev/nbd1 is already the device of line 3; this line is skipped`,
	}
	if !reflect.DeepEqual(msgs, want) {
		t.Errorf("errors:\n%s\nwant:\n%s", strings.Join(msgs, "\n"), strings.Join(want, "\n"))
	}
	var le *LineError
	if !errors.As(errs[0], &le) || le.Line != 5 || le.Field != "options" {
		t.Errorf("first error %+v", errs[0])
	}
}

func TestReadFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	vols, errs, err := ReadFile(filepath.Join(dir, "missing"))
	if err != nil || vols != nil || errs != nil {
		t.Errorf("a missing table: %v %v %v; want an empty one", vols, errs, err)
	}
	long := filepath.Join(dir, "long")
	os.WriteFile(long, []byte("a /dev/sda1\nb /dev/sdb1 - "+strings.Repeat("nofail,", 3000)+"\n"), 0o644)
	vols, _, err = ReadFile(long)
	if err == nil || !strings.Contains(err.Error(), "line 2 is longer than 16384 bytes") || len(vols) != 1 {
		t.Errorf("an overlong line: %v (volumes %d); want the error, and line 1 kept", err, len(vols))
	}
	if _, _, err := ReadFile(dir); err == nil {
		t.Error("a directory read as a table")
	}
}

func TestManPageNamesEveryOption(t *testing.T) {
	t.Parallel()
	for _, opt := range []string{"_netdev", "noauto", "nofail", "readonly", "timeout=", "tries=", "device=", "connections=",
		"witness=", "key-slot=", "keyscript=", "tls-certificates=", "tls-hostname=", "tls-verify-peer=",
		"x-systemd.requires=", "x-systemd.after=", "x-systemd.before=", "x-systemd.requires-mounts-for=",
		"cred:", "cred-encrypted:"} {
		if !strings.Contains(ManPage, "**"+opt) {
			t.Errorf("elitab(5) does not describe %s", opt)
		}
	}
}

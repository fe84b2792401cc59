// Package elitab reads /etc/elitab, the table of eli volumes that a machine attaches at
// boot, as /etc/crypttab lists dm-crypt volumes: one volume a line, with its name, its
// provider, where its key comes from and its options. elitab(5), embedded here as
// ManPage, is the reference; this package is its one parser, shared by the systemd
// generator and 'eli elitab'.
//
// A line that does not parse is reported (file, line, field and what is wrong) and
// skipped; the other lines still count, so that one typo does not keep every volume
// from attaching.
package elitab

import (
	"bufio"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/nbdkernel"
)

// Path is where the table lives.
const Path = "/etc/elitab"

// ManPage is elitab(5) in the Markdown that go-md2man turns into a man page.
//
//go:embed elitab.5.md
var ManPage string

// Defaults for options a line leaves out.
const (
	// DefaultTimeout bounds a key command and a password prompt (timeout=).
	DefaultTimeout = 90 * time.Second
	// DefaultTries is how many passphrases a prompt takes before the unit fails (tries=).
	DefaultTries = 3
	// DeviceAuto asks eli to pick a free /dev/nbdN (device=auto, the default).
	DeviceAuto = "auto"
)

// Bounds on what a line may ask for.
const (
	maxLine      = 16 << 10
	maxLines     = 100000
	maxTimeout   = 24 * time.Hour
	maxTries     = 100
	maxConns     = 64
	maxSlot      = 7
	maxUnitNames = 64
)

// KeyKind is where a volume's key comes from.
type KeyKind int

const (
	// KeyAsk: a passphrase asked for at boot through systemd's password agent ("-" or
	// "none" in the key field).
	KeyAsk KeyKind = iota
	// KeyFile: the whole file is a key (a keyfile), as in crypttab.
	KeyFile
	// KeyCredential: a systemd credential (cred:ID[:PATH]) holds the key.
	KeyCredential
	// KeyEncryptedCredential: an encrypted systemd credential (systemd-creds encrypt,
	// sealed to the TPM if asked), cred-encrypted:ID[:PATH].
	KeyEncryptedCredential
	// KeyCommand: the keyscript= program's standard output is the key.
	KeyCommand
)

func (k KeyKind) String() string {
	switch k {
	case KeyAsk:
		return "ask"
	case KeyFile:
		return "keyfile"
	case KeyCredential:
		return "credential"
	case KeyEncryptedCredential:
		return "encrypted credential"
	case KeyCommand:
		return "key command"
	}
	return fmt.Sprintf("KeyKind(%d)", int(k))
}

// Key says where a volume's key comes from.
type Key struct {
	Kind KeyKind
	// Path is the keyfile (KeyFile), or the file a credential is loaded from when the
	// line names one (empty: systemd's credential store and system credentials).
	Path string
	// Credential is the credential's ID (KeyCredential, KeyEncryptedCredential).
	Credential string
	// Command is the key command's argv (KeyCommand): keyscript= and, unless the key
	// field is "-" or "none", the key field as its one argument (Debian's crypttab
	// convention).
	Command []string
}

// Volume is one line of the table.
type Volume struct {
	Line     int
	Name     string
	Provider string // a path, or an NBD URI with the line's TLS options in its query
	Remote   bool   // Provider is an NBD URI
	Key      Key

	NetDev   bool          // _netdev: needs the network
	NoAuto   bool          // noauto: not attached at boot unless something needs it
	NoFail   bool          // nofail: boot goes on without it
	ReadOnly bool          // readonly, read-only
	Timeout  time.Duration // timeout=: bounds the key command or prompt
	Tries    int           // tries=: passphrases a prompt takes
	// Device is "" (device=none: the NBD export only), DeviceAuto, or /dev/nbdN.
	Device      string
	Connections int    // connections=: kernel device sockets (0: eli's default)
	Witness     string // witness=FILE (empty: eli's default place)
	KeySlot     int    // key-slot=N, or -1 for any

	// x-systemd.requires= (Requires= and After=), x-systemd.after=, x-systemd.before=,
	// x-systemd.requires-mounts-for=: ordering for what eli cannot see, such as the NBD
	// server of a provider on the same machine.
	Requires, After, Before, RequiresMountsFor []string
}

// LineError is one malformed line: where, which field, and what is wrong.
type LineError struct {
	File  string
	Line  int
	Field string // "name", "provider", "key", "options: timeout=", or "" for the whole line
	Err   error
}

func (e *LineError) Error() string {
	field := ""
	if e.Field != "" {
		field = " " + e.Field + ":"
	}
	return fmt.Sprintf("%s:%d:%s %v; this line is skipped", e.File, e.Line, field, e.Err)
}

func (e *LineError) Unwrap() error { return e.Err }

// ReadFile parses the table at path. A missing file is an empty table. It returns the
// volumes of every good line, the errors of the others, and an error only when the file
// cannot be read at all.
func ReadFile(path string) ([]Volume, []*LineError, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	return Parse(path, f)
}

// Parse reads a table from r; name is the file name messages give.
func Parse(name string, r io.Reader) ([]Volume, []*LineError, error) {
	var vols []Volume
	var errs []*LineError
	names := map[string]int{}
	devices := map[string]int{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxLine)
	n := 0
	for sc.Scan() {
		n++
		if n > maxLines {
			return vols, errs, fmt.Errorf("%s: more than %d lines", name, maxLines)
		}
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		v, err := parseLine(line)
		if err == nil && names[v.Name] != 0 {
			err = &LineError{Field: "name", Err: fmt.Errorf("%q is already the name of line %d", v.Name, names[v.Name])}
		}
		if err == nil && strings.HasPrefix(v.Device, "/dev/") && devices[v.Device] != 0 {
			err = &LineError{Field: "options: device=", Err: fmt.Errorf("%s is already the device of line %d", v.Device, devices[v.Device])}
		}
		if err != nil {
			le := err.(*LineError)
			le.File, le.Line = name, n
			errs = append(errs, le)
			continue
		}
		v.Line = n
		names[v.Name] = n
		if strings.HasPrefix(v.Device, "/dev/") {
			devices[v.Device] = n
		}
		vols = append(vols, v)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return vols, errs, fmt.Errorf("%s: line %d is longer than %d bytes", name, n+1, maxLine)
		}
		return vols, errs, fmt.Errorf("read %s: %w", name, err)
	}
	return vols, errs, nil
}

func fieldErr(field, format string, args ...any) *LineError {
	return &LineError{Field: field, Err: fmt.Errorf(format, args...)}
}

// parseLine parses one line that is neither blank nor a comment. Its errors are
// *LineError without file and line.
func parseLine(line string) (Volume, error) {
	raw := strings.Fields(line)
	if len(raw) < 2 || len(raw) > 4 {
		return Volume{}, &LineError{Err: fmt.Errorf("%d fields; a line is NAME PROVIDER [KEY [OPTIONS]]", len(raw))}
	}
	fields := make([]string, len(raw))
	for i, f := range raw {
		u, err := unescape(f)
		if err != nil {
			return Volume{}, fieldErr([]string{"name", "provider", "key", "options"}[i], "%v", err)
		}
		fields[i] = u
	}
	v := Volume{Name: fields[0], Provider: fields[1], KeySlot: -1, Timeout: DefaultTimeout, Tries: DefaultTries, Device: DeviceAuto}
	if err := daemon.ValidName(v.Name); err != nil {
		return Volume{}, fieldErr("name", "%v", err)
	}
	keyField := "-"
	if len(fields) > 2 {
		keyField = fields[2]
	}
	optField := ""
	if len(fields) > 3 {
		optField = fields[3]
	}
	tls, err := v.parseOptions(optField)
	if err != nil {
		return Volume{}, err
	}
	if err := v.parseProvider(tls); err != nil {
		return Volume{}, err
	}
	if err := v.parseKey(keyField); err != nil {
		return Volume{}, err
	}
	return v, nil
}

// tlsOptions are the options that go into a remote provider's URI.
type tlsOptions struct {
	certDir, hostname string
	verifyPeer        *bool
}

func (t tlsOptions) any() bool { return t.certDir != "" || t.hostname != "" || t.verifyPeer != nil }

func (v *Volume) parseProvider(tls tlsOptions) error {
	p := v.Provider
	if !nbdclient.IsURI(p) {
		if !filepath.IsAbs(p) {
			return fieldErr("provider", "%q is neither an absolute path nor an NBD URI (nbd://, nbds://, nbd+unix://, nbds+unix://)", p)
		}
		if tls.any() {
			return fieldErr("options", "the TLS options (tls-certificates=, tls-hostname=, tls-verify-peer=) apply to an nbds:// or nbds+unix:// provider, not to %s", p)
		}
		v.Provider = filepath.Clean(p)
		return nil
	}
	t, err := nbdclient.ParseURI(p)
	if err != nil {
		return fieldErr("provider", "%v", err)
	}
	if tls.any() && !t.TLS {
		return fieldErr("options", "the TLS options apply to an nbds:// or nbds+unix:// provider; %s does not use TLS", p)
	}
	merge := func(opt, have, want string) error {
		if have != "" && have != want {
			return fieldErr("options: "+opt+"=", "the provider's URI already says %s=%s", opt, have)
		}
		return nil
	}
	if tls.certDir != "" {
		if err := merge("tls-certificates", t.CertDir, tls.certDir); err != nil {
			return err
		}
		t.CertDir = tls.certDir
	}
	if tls.hostname != "" {
		if err := merge("tls-hostname", t.Hostname, tls.hostname); err != nil {
			return err
		}
		t.Hostname = tls.hostname
	}
	if tls.verifyPeer != nil {
		t.VerifyPeer = *tls.verifyPeer
	}
	v.Provider, v.Remote = t.String(), true
	return nil
}

var credentialRE = regexp.MustCompile(`^[A-Za-z0-9_@+-][A-Za-z0-9._@+-]{0,254}$`)

func (v *Volume) parseKey(f string) error {
	if len(v.Key.Command) > 0 { // keyscript= was given: the field is its argument
		if f != "-" && f != "none" {
			v.Key.Command = append(v.Key.Command, f)
		}
		return nil
	}
	var kind KeyKind
	var rest string
	switch {
	case f == "-" || f == "none":
		v.Key = Key{Kind: KeyAsk}
		return nil
	case strings.HasPrefix(f, "cred:"):
		kind, rest = KeyCredential, strings.TrimPrefix(f, "cred:")
	case strings.HasPrefix(f, "cred-encrypted:"):
		kind, rest = KeyEncryptedCredential, strings.TrimPrefix(f, "cred-encrypted:")
	case filepath.IsAbs(f):
		v.Key = Key{Kind: KeyFile, Path: filepath.Clean(f)}
		return nil
	default:
		return fieldErr("key", "%q is none of: - or none (ask for a passphrase), an absolute keyfile path, cred:ID[:PATH], cred-encrypted:ID[:PATH]", f)
	}
	id, path, hasPath := strings.Cut(rest, ":")
	if !credentialRE.MatchString(id) {
		return fieldErr("key", "%q: a credential ID is 1 to 255 letters, digits and . _ @ + - (not starting with a dot)", id)
	}
	if hasPath && !filepath.IsAbs(path) {
		return fieldErr("key", "%q: the credential's file must be an absolute path", path)
	}
	if hasPath {
		path = filepath.Clean(path)
	}
	v.Key = Key{Kind: kind, Credential: id, Path: path}
	return nil
}

// unitRE accepts the characters of a systemd unit name with a suffix (systemd.unit(5)).
var unitRE = regexp.MustCompile(`^[A-Za-z0-9:_.\\@-]{1,250}\.(service|socket|device|mount|automount|swap|target|path|timer|slice|scope)$`)

func (v *Volume) parseOptions(f string) (tlsOptions, error) {
	var tls tlsOptions
	if f == "" || f == "-" || f == "none" || f == "defaults" {
		return tls, nil
	}
	seen := map[string]bool{}
	var keyscript string
	for _, opt := range strings.Split(f, ",") {
		key, val, hasVal := strings.Cut(opt, "=")
		field := "options: " + key
		if hasVal {
			field += "="
		}
		bad := func(format string, args ...any) error { return fieldErr(field, format, args...) }
		repeatable := strings.HasPrefix(key, "x-systemd.")
		if seen[key] && !repeatable {
			return tls, bad("given twice")
		}
		seen[key] = true
		flag := func(b *bool, want bool) error {
			if hasVal {
				return bad("takes no value")
			}
			*b = want
			return nil
		}
		value := func() (string, error) {
			if !hasVal || val == "" {
				return "", bad("needs a value (%s=...)", key)
			}
			return val, nil
		}
		var err error
		switch key {
		case "":
			err = fieldErr("options", "an empty option (two commas, or a comma at an end)")
		case "_netdev":
			err = flag(&v.NetDev, true)
		case "noauto":
			err = flag(&v.NoAuto, true)
		case "auto":
			err = flag(&v.NoAuto, false)
		case "nofail":
			err = flag(&v.NoFail, true)
		case "fail":
			err = flag(&v.NoFail, false)
		case "readonly", "read-only":
			if seen["readonly"] && seen["read-only"] {
				return tls, bad("given twice")
			}
			err = flag(&v.ReadOnly, true)
		case "timeout":
			var s string
			if s, err = value(); err == nil {
				v.Timeout, err = parseTimespan(s)
				if err != nil {
					err = bad("%v", err)
				}
			}
		case "tries":
			err = intOption(&v.Tries, val, hasVal, 1, maxTries, bad)
		case "connections":
			err = intOption(&v.Connections, val, hasVal, 1, maxConns, bad)
		case "key-slot":
			err = intOption(&v.KeySlot, val, hasVal, 0, maxSlot, bad)
		case "device":
			var s string
			if s, err = value(); err != nil {
				break
			}
			switch s {
			case "auto":
				v.Device = DeviceAuto
			case "none":
				v.Device = ""
			default:
				if _, perr := nbdkernel.ParseDevice(s); perr != nil {
					err = bad("%q is none of: auto, none, /dev/nbdN", s)
				}
				v.Device = s
			}
		case "witness":
			if v.Witness, err = value(); err == nil && !filepath.IsAbs(v.Witness) {
				err = bad("%q is not an absolute path", v.Witness)
			}
		case "keyscript":
			if keyscript, err = value(); err == nil && !filepath.IsAbs(keyscript) {
				err = bad("%q is not an absolute path (eli runs it without a shell or a search path)", keyscript)
			}
		case "tls-certificates":
			if tls.certDir, err = value(); err == nil && !filepath.IsAbs(tls.certDir) {
				err = bad("%q is not an absolute path", tls.certDir)
			}
		case "tls-hostname":
			tls.hostname, err = value()
		case "tls-verify-peer":
			var s string
			if s, err = value(); err == nil {
				b, perr := parseBool(s)
				if perr != nil {
					err = bad("%v", perr)
				}
				tls.verifyPeer = &b
			}
		case "x-systemd.requires", "x-systemd.after", "x-systemd.before":
			var u string
			if u, err = value(); err == nil && !unitRE.MatchString(u) {
				err = bad("%q is not a unit name (NAME.service, NAME.target, ...)", u)
			}
			list := map[string]*[]string{"x-systemd.requires": &v.Requires, "x-systemd.after": &v.After, "x-systemd.before": &v.Before}[key]
			if err == nil && len(*list) >= maxUnitNames {
				err = bad("more than %d", maxUnitNames)
			}
			if err == nil {
				*list = append(*list, u)
			}
		case "x-systemd.requires-mounts-for":
			var p string
			if p, err = value(); err == nil && !filepath.IsAbs(p) {
				err = bad("%q is not an absolute path", p)
			}
			if err == nil && len(v.RequiresMountsFor) >= maxUnitNames {
				err = bad("more than %d", maxUnitNames)
			}
			if err == nil {
				v.RequiresMountsFor = append(v.RequiresMountsFor, filepath.Clean(p))
			}
		default:
			err = fieldErr("options", "unknown option %q (elitab(5) lists them)", opt)
		}
		if err != nil {
			return tls, err
		}
	}
	if keyscript != "" {
		v.Key = Key{Kind: KeyCommand, Command: []string{keyscript}}
	}
	if v.Device == "" && v.Connections != 0 {
		return tls, fieldErr("options: connections=", "applies to a kernel device, and this line has device=none")
	}
	return tls, nil
}

func intOption(dst *int, val string, hasVal bool, lo, hi int, bad func(string, ...any) error) error {
	if !hasVal || val == "" {
		return bad("needs a number")
	}
	n, err := strconv.Atoi(val)
	if err != nil || n < lo || n > hi {
		return bad("%q is not a number from %d to %d", val, lo, hi)
	}
	*dst = n
	return nil
}

func parseBool(s string) (bool, error) {
	switch strings.ToLower(s) {
	case "1", "yes", "y", "true", "t", "on":
		return true, nil
	case "0", "no", "n", "false", "f", "off":
		return false, nil
	}
	return false, fmt.Errorf("%q is not yes or no", s)
}

// timespanUnits are the units of systemd.time(7) a timeout takes.
var timespanUnits = map[string]time.Duration{
	"ms": time.Millisecond, "msec": time.Millisecond,
	"s": time.Second, "sec": time.Second, "second": time.Second, "seconds": time.Second,
	"m": time.Minute, "min": time.Minute, "minute": time.Minute, "minutes": time.Minute,
	"h": time.Hour, "hr": time.Hour, "hour": time.Hour, "hours": time.Hour,
}

// parseTimespan reads a time span as systemd.time(7) writes one: a bare number is
// seconds, and "90s", "5min", "1h 30min" add up. Zero is refused: nothing eli waits for
// at boot waits forever.
func parseTimespan(s string) (time.Duration, error) {
	bad := fmt.Errorf("%q is not a time span (seconds, or e.g. 90s, 5min, 1h 30min)", s)
	var total time.Duration
	rest := strings.TrimSpace(s)
	if rest == "" {
		return 0, bad
	}
	for rest != "" {
		i := 0
		for i < len(rest) && rest[i] >= '0' && rest[i] <= '9' {
			i++
		}
		if i == 0 || i > 9 {
			return 0, bad
		}
		n, _ := strconv.Atoi(rest[:i])
		rest = strings.TrimLeft(rest[i:], " ")
		j := 0
		for j < len(rest) && rest[j] >= 'a' && rest[j] <= 'z' {
			j++
		}
		unit := time.Second
		if j > 0 {
			u, ok := timespanUnits[rest[:j]]
			if !ok {
				return 0, fmt.Errorf("%q: unknown unit %q (ms, s, min, h)", s, rest[:j])
			}
			unit = u
		}
		total += time.Duration(n) * unit
		if total > maxTimeout {
			return 0, fmt.Errorf("%q is longer than %v", s, maxTimeout)
		}
		rest = strings.TrimLeft(rest[j:], " ")
	}
	if total <= 0 {
		return 0, fmt.Errorf("%q: a timeout must be positive (nothing waits forever)", s)
	}
	return total, nil
}

// unescape undoes fstab(5)'s octal escapes (\040 for a space, \011 for a tab, \134 for
// a backslash), the only way a field holds a blank.
func unescape(f string) (string, error) {
	if !strings.Contains(f, `\`) {
		return f, nil
	}
	var b strings.Builder
	for i := 0; i < len(f); i++ {
		if f[i] != '\\' {
			b.WriteByte(f[i])
			continue
		}
		if i+4 > len(f) {
			return "", fmt.Errorf("%q: a backslash starts an octal escape such as \\040 (a space)", f)
		}
		n, err := strconv.ParseUint(f[i+1:i+4], 8, 8)
		if err != nil || n == 0 {
			return "", fmt.Errorf("%q: %q is not an octal escape such as \\040 (a space)", f, f[i:i+4])
		}
		b.WriteByte(byte(n))
		i += 3
	}
	return b.String(), nil
}

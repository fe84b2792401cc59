package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// The state directory holds, per attached volume NAME:
//
//	NAME.lock  flock'ed by the server for its whole life: the liveness test. A record whose
//	           lock can be taken belongs to a server that is gone (killed, crashed).
//	NAME.json  the record `eli list` and `eli detach` read, written once the export is ready
//	NAME.sock  the default unix socket
//	NAME.log   the server's log when it runs in the background
//
// Liveness comes from the lock, never from a pid, so a recycled pid cannot be mistaken for
// a server, and anything a killed server left behind never blocks the next attach.

// record describes one attached volume.
type record struct {
	Name       string `json:"name"`
	Provider   string `json:"provider"`
	Dev        uint64 `json:"dev"`
	Ino        uint64 `json:"ino"`
	Mode       string `json:"mode"`
	SectorSize int    `json:"sector_size"`
	Size       int64  `json:"size"`
	Socket     string `json:"socket"`
	Listen     string `json:"listen,omitempty"`
	URI        string `json:"uri"`
	Device     string `json:"device,omitempty"`
	DeviceIdx  int    `json:"device_index,omitempty"`
	ReadOnly   bool   `json:"readonly,omitempty"`
	Onetime    bool   `json:"onetime,omitempty"`
	Pid        int    `json:"pid"`
	Log        string `json:"log,omitempty"`
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$`)

func validName(name string) error {
	if !nameRE.MatchString(name) || strings.HasSuffix(name, ".") {
		return usagef("invalid name %q: use up to 64 letters, digits and . _ + - (not starting with a dot)", name)
	}
	return nil
}

// defaultName is the provider's base name, made valid.
func defaultName(provider string) string {
	base := filepath.Base(provider)
	b := []byte(base)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '+' || c == '-') {
			b[i] = '_'
		}
	}
	s := strings.TrimLeft(string(b), ".")
	if len(s) > 64 {
		s = s[:64]
	}
	if s == "" {
		s = "eli"
	}
	return s
}

type stateDir struct{ path string }

func resolveStateDir(g *globalOptions) (stateDir, error) {
	dir := g.stateDir
	if dir == "" {
		dir = os.Getenv("ELI_STATE_DIR")
	}
	if dir == "" {
		switch {
		case os.Geteuid() == 0:
			dir = "/run/eli"
		case os.Getenv("XDG_RUNTIME_DIR") != "":
			dir = filepath.Join(os.Getenv("XDG_RUNTIME_DIR"), "eli")
		default:
			dir = filepath.Join(os.TempDir(), fmt.Sprintf("eli-%d", os.Geteuid()))
		}
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return stateDir{}, err
	}
	return stateDir{abs}, nil
}

func (s stateDir) ensure() error {
	if err := os.MkdirAll(s.path, 0o700); err != nil {
		return fmt.Errorf("create state directory: %w", err)
	}
	st, err := os.Stat(s.path)
	if err != nil {
		return err
	}
	if st.Mode().Perm()&0o077 != 0 {
		return fmt.Errorf("state directory %s is accessible to others (mode %v): it must be 0700", s.path, st.Mode().Perm())
	}
	return nil
}

func (s stateDir) file(name, ext string) string { return filepath.Join(s.path, name+ext) }

// nameLock is the flock a live server holds on NAME.lock.
type nameLock struct{ f *os.File }

// lockName takes NAME's lock; it fails with errNameTaken if a live server has it.
func (s stateDir) lockName(name string) (*nameLock, error) {
	if err := s.ensure(); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(s.file(name, ".lock"), os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock for %s: %w", name, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if err == unix.EWOULDBLOCK {
			return nil, errNameTaken
		}
		return nil, fmt.Errorf("lock %s: %w", name, err)
	}
	return &nameLock{f}, nil
}

var errNameTaken = errors.New("name is in use")

func (l *nameLock) release() { l.f.Close() }

// alive reports whether a server holds NAME's lock right now.
func (s stateDir) alive(name string) bool {
	f, err := os.Open(s.file(name, ".lock"))
	if err != nil {
		return false
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err == unix.EWOULDBLOCK {
		return true
	}
	return false
}

// cleanup removes what a server for name may have left behind. Call it only while
// holding the name's lock, or after alive(name) said no.
func (s stateDir) cleanup(name string, rec *record) {
	if rec != nil && rec.Socket != "" && rec.Socket != s.file(name, ".sock") {
		removeIfSocket(rec.Socket)
	}
	removeIfSocket(s.file(name, ".sock"))
	os.Remove(s.file(name, ".json"))
}

func removeIfSocket(path string) {
	if st, err := os.Lstat(path); err == nil && st.Mode()&fs.ModeSocket != 0 {
		os.Remove(path)
	}
}

func (s stateDir) writeRecord(r *record) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	tmp := s.file(r.Name, ".json.tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	if err := os.Rename(tmp, s.file(r.Name, ".json")); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write state: %w", err)
	}
	return nil
}

func (s stateDir) readRecord(name string) (*record, error) {
	b, err := os.ReadFile(s.file(name, ".json"))
	if err != nil {
		return nil, err
	}
	if len(b) > 1<<20 {
		return nil, fmt.Errorf("state file for %s is implausibly large", name)
	}
	var r record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("state file for %s is damaged: %w", name, err)
	}
	return &r, nil
}

// live lists the records of running servers, sorted by name, and clears away what dead
// ones left behind.
func (s stateDir) live() ([]*record, error) {
	ents, err := os.ReadDir(s.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read state directory: %w", err)
	}
	var out []*record
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || validName(name) != nil {
			continue
		}
		rec, err := s.readRecord(name)
		if !s.alive(name) {
			if l, lerr := s.lockName(name); lerr == nil {
				s.cleanup(name, rec)
				l.release()
			}
			continue
		}
		if err != nil {
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// fileID identifies a provider independently of the path used to name it.
func fileID(path string) (dev, ino uint64, err error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, 0, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		return st.Rdev, 0, nil
	}
	return st.Dev, st.Ino, nil
}

// find resolves what the user typed (a name, or a provider path) to a live record.
func (s stateDir) find(arg string) (*record, error) {
	recs, err := s.live()
	if err != nil {
		return nil, err
	}
	for _, r := range recs {
		if r.Name == arg {
			return r, nil
		}
	}
	if dev, ino, err := fileID(arg); err == nil {
		for _, r := range recs {
			if r.Dev == dev && r.Ino == ino {
				return r, nil
			}
		}
	}
	return nil, fmt.Errorf("%s is not attached (see 'eli list')", arg)
}

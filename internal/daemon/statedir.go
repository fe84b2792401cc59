package daemon

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/control"
	"github.com/elidisk/eli/volume"
	"golang.org/x/sys/unix"
)

// StateDir is the directory that holds, per attached volume NAME:
//
//	NAME.lock    flock'ed by the server for its whole life: the liveness test. A record
//	             whose lock can be taken belongs to a server that is gone (killed,
//	             crashed). It holds the pid of its holder, so that a server is found
//	             whatever state it is in. The server removes it, still holding it, as
//	             the very last thing it does.
//	NAME.json    the record `eli list` and `eli detach` read, written once the export is
//	             ready and removed with the lock: a server that still runs has one
//	NAME.stop    the deadline `eli detach` gives the server's shutdown
//	NAME.sock    the default unix socket
//	NAME.ctl     the control socket: requests to the running server (package control)
//	NAME.status  the server's volume.Status, rewritten while it runs
//	NAME.log     the server's log when it runs in the background, at most MaxLogBytes,
//	             with one older part in NAME.log.1
//
// A server that stops cleanly removes all of them. One whose volume failed keeps
// NAME.status and NAME.log, so that `eli detach`, `eli status` and the user can read what
// went wrong; the next attach of NAME removes them.
//
// Liveness comes from the lock, never from a pid, so a recycled pid cannot be mistaken for
// a server, and anything a killed server left behind never blocks the next attach.
type StateDir struct{ Path string }

// States List gives besides a Status's.
const (
	StateStarting = "starting" // the process holds the name but has no record yet
	StateFrozen   = "frozen"   // the process is stopped (SIGSTOP, a debugger) and answers nothing
)

// Record describes one attached volume.
type Record struct {
	Name       string `json:"name"`
	Provider   string `json:"provider"`
	Dev        uint64 `json:"dev"`
	Ino        uint64 `json:"ino"`
	Mode       string `json:"mode"`
	Format     int    `json:"format"` // on-disk format version: 1, or 2 with the hash tree
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
	VolumeID   string `json:"volume_id,omitempty"` // hex
	// Warnings are what the attach found wrong that does not stop the volume (header
	// copy B missing, no witness to check the provider against, a witness that cannot
	// be written); attach prints them.
	Warnings []string `json:"warnings,omitempty"`
}

// newRecord describes the server srv started with cfg.
func newRecord(cfg *Setup, srv *volume.Server) *Record {
	v := srv.Volume()
	dev, ino, _ := FileID(cfg.Provider)
	return &Record{
		Name: cfg.Name, Provider: cfg.Provider, Dev: dev, Ino: ino, Mode: v.Mode().String(), Format: v.Format(),
		SectorSize: v.SectorSize(), Size: v.Size(), Socket: cfg.Socket, Listen: srv.TCPAddr(), URI: volume.UnixURI(cfg.Socket),
		Device: cfg.Device, DeviceIdx: srv.DeviceIndex(), ReadOnly: cfg.ReadOnly, Onetime: cfg.Onetime,
		Pid: os.Getpid(), Log: cfg.LogFile, VolumeID: hex.EncodeToString(cfg.VolumeID[:]), Warnings: v.Warnings(),
	}
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$`)

// ValidName checks a volume's name: it names files in the state directory.
func ValidName(name string) error {
	if !nameRE.MatchString(name) || strings.HasSuffix(name, ".") {
		return fmt.Errorf("invalid name %q: use up to 64 letters, digits and . _ + - (not starting with a dot)", name)
	}
	return nil
}

// DefaultName is the provider's base name, made valid.
func DefaultName(provider string) string {
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

// ResolveStateDir is dir, or else $ELI_STATE_DIR, or else the default: /run/eli for
// root, $XDG_RUNTIME_DIR/eli, or /tmp/eli-UID.
func ResolveStateDir(dir string) (StateDir, error) {
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
		return StateDir{}, err
	}
	return StateDir{abs}, nil
}

func (s StateDir) ensure() error {
	if err := os.MkdirAll(s.Path, 0o700); err != nil {
		return fmt.Errorf("create state directory: %w", err)
	}
	st, err := os.Stat(s.Path)
	if err != nil {
		return err
	}
	if st.Mode().Perm()&0o077 != 0 {
		return fmt.Errorf("state directory %s is accessible to others (mode %v): it must be 0700", s.Path, st.Mode().Perm())
	}
	return nil
}

// File is NAME+ext in the directory.
func (s StateDir) File(name, ext string) string { return filepath.Join(s.Path, name+ext) }

// ControlSocket is the socket on which the server of name answers control.Call.
func (s StateDir) ControlSocket(name string) string { return s.File(name, control.Ext) }

// NameLock is the flock a live server holds on NAME.lock.
type NameLock struct {
	f    *os.File
	path string
	dir  StateDir
	name string
}

// ErrNameTaken: a live server holds the name.
var ErrNameTaken = errors.New("name is in use")

// LockName takes NAME's lock; it fails with ErrNameTaken if a live server has it.
func (s StateDir) LockName(name string) (*NameLock, error) {
	if err := s.ensure(); err != nil {
		return nil, err
	}
	path := s.File(name, ".lock")
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("open lock for %s: %w", name, err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if err == unix.EWOULDBLOCK {
				return nil, ErrNameTaken
			}
			return nil, fmt.Errorf("lock %s: %w", name, err)
		}
		// Its holder removes the file before it lets go: a lock on a file that is no
		// longer at path is a lock on nothing, so try again with whatever is there now.
		if samePath(f, path) {
			l := &NameLock{f: f, path: path, dir: s, name: name}
			l.SetPID(os.Getpid())
			return l, nil
		}
		f.Close()
	}
}

// NameHeldError: a live process holds the name. Record is the volume it serves, or nil
// while that process is still starting its server.
type NameHeldError struct {
	Name   string
	PID    int
	Record *Record
}

func (e *NameHeldError) Error() string {
	if e.Record != nil {
		return fmt.Sprintf("the name %s is attached to %s (pid %d)", e.Name, e.Record.Provider, e.PID)
	}
	return fmt.Sprintf("the name %s is being attached by pid %d", e.Name, e.PID)
}

func (e *NameHeldError) Unwrap() error { return ErrNameTaken }

// LockNameWait is LockName for an attach: a name whose holder is still starting (no
// record yet: it may fail) is waited for, up to wait (volume.DefaultLockWait when 0); a name
// that a server holds, or one still held after the wait, fails with *NameHeldError.
func (s StateDir) LockNameWait(name string, wait time.Duration) (*NameLock, error) {
	if wait == 0 {
		wait = volume.DefaultLockWait
	}
	for deadline := time.Now().Add(wait); ; time.Sleep(50 * time.Millisecond) {
		l, err := s.LockName(name)
		if !errors.Is(err, ErrNameTaken) {
			return l, err
		}
		e := &NameHeldError{Name: name, PID: s.lockPID(name)}
		if rec, rerr := s.ReadRecord(name); rerr == nil {
			e.Record = rec
		}
		if e.Record != nil || !time.Now().Before(deadline) {
			return nil, e
		}
	}
}

// NameLockFromFile adopts a lock inherited already locked (the background server's),
// and says in it that this process holds it now.
func (s StateDir) NameLockFromFile(f *os.File, name string) *NameLock {
	l := &NameLock{f: f, path: s.File(name, ".lock"), dir: s, name: name}
	l.SetPID(os.Getpid())
	return l
}

// SetPID writes pid into the lock file, for List to name the process that holds it.
func (l *NameLock) SetPID(pid int) {
	if err := l.f.Truncate(0); err == nil {
		l.f.WriteAt([]byte(strconv.Itoa(pid)+"\n"), 0)
	}
}

// lockPID is the pid the holder of NAME's lock wrote in it, or 0.
func (s StateDir) lockPID(name string) int {
	b, err := os.ReadFile(s.File(name, ".lock"))
	if err != nil || len(b) > 32 {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// File is the locked file, for a child process to inherit.
func (l *NameLock) File() *os.File { return l.f }

// Release removes the record, the stop request and the lock file, and lets go of the
// lock: the name is free and leaves nothing behind but a failed server's status and
// log. Only the lock's holder may call it (the files are removed while locked).
func (l *NameLock) Release() {
	if samePath(l.f, l.path) {
		os.Remove(l.dir.File(l.name, ".json"))
		os.Remove(l.dir.File(l.name, ".stop"))
		os.Remove(l.path)
	}
	l.f.Close()
}

// Close lets go of this process's hold on the lock and leaves the file: for a process
// that handed the lock to a child, which holds it on.
func (l *NameLock) Close() { l.f.Close() }

// samePath reports whether f is still the file at path.
func samePath(f *os.File, path string) bool {
	a, err1 := f.Stat()
	b, err2 := os.Stat(path)
	return err1 == nil && err2 == nil && os.SameFile(a, b)
}

// Alive reports whether a server holds NAME's lock right now.
func (s StateDir) Alive(name string) bool {
	f, err := os.Open(s.File(name, ".lock"))
	if err != nil {
		return false
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err == unix.EWOULDBLOCK {
		return true
	}
	return false
}

// WaitGone waits until no server holds NAME's lock, for at most timeout.
func (s StateDir) WaitGone(name string, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for s.Alive(name) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// Cleanup removes what a server for name may have left behind: its socket and record,
// and with all also its status and log (those of a failed server are kept for the user
// until the next attach of the name). Call it only while holding the name's lock, or
// after Alive(name) said no.
func (s StateDir) Cleanup(name string, rec *Record, all bool) {
	if rec != nil && rec.Socket != "" && rec.Socket != s.File(name, ".sock") {
		removeIfSocket(rec.Socket)
	}
	removeIfSocket(s.File(name, ".sock"))
	removeIfSocket(s.ControlSocket(name))
	os.Remove(s.File(name, ".json"))
	os.Remove(s.File(name, ".stop"))
	if all {
		os.Remove(s.File(name, ".status"))
		os.Remove(s.File(name, ".log"))
		os.Remove(s.File(name, ".log.1"))
	}
}

func removeIfSocket(path string) {
	if st, err := os.Lstat(path); err == nil && st.Mode()&fs.ModeSocket != 0 {
		os.Remove(path)
	}
}

// writeJSON replaces NAME+ext with v, atomically.
func (s StateDir) writeJSON(name, ext string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := s.File(name, ext+".tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	if err := os.Rename(tmp, s.File(name, ext)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write state: %w", err)
	}
	return nil
}

// readJSON reads NAME+ext into v, refusing a file too large to be ours.
func (s StateDir) readJSON(name, ext string, v any) error {
	b, err := os.ReadFile(s.File(name, ext))
	if err != nil {
		return err
	}
	if len(b) > 1<<20 {
		return fmt.Errorf("state file %s%s is implausibly large", name, ext)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("state file %s%s is damaged: %w", name, ext, err)
	}
	return nil
}

// WriteRecord writes the record of an attached volume.
func (s StateDir) WriteRecord(r *Record) error { return s.writeJSON(r.Name, ".json", r) }

// ReadRecord reads NAME's record.
func (s StateDir) ReadRecord(name string) (*Record, error) {
	var r Record
	if err := s.readJSON(name, ".json", &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// WriteStatus writes NAME's status.
func (s StateDir) WriteStatus(st *volume.Status) error { return s.writeJSON(st.Name, ".status", st) }

// liveStatusWait bounds ReadStatus's question to a running server, which a stopped
// process (SIGSTOP) never answers.
const liveStatusWait = time.Second

// ReadStatus reads NAME's status: the live one of a running server, asked over its
// control socket (the status file lags a change by up to statusEvery, so a client that
// just saw a write fail could read "serving" there), or else the one in the status
// file: a server's that does not answer, or the last one of a server that stopped.
func (s StateDir) ReadStatus(name string) (*volume.Status, error) {
	ctx, cancel := context.WithTimeout(context.Background(), liveStatusWait)
	defer cancel()
	var live volume.Status
	if err := control.Call(ctx, s.ControlSocket(name), OpStatus, nil, nil, &live); err == nil {
		return &live, nil
	}
	var st volume.Status
	if err := s.readJSON(name, ".status", &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// Entry is a server List found: every process that holds a name's lock, whatever
// state it is in.
type Entry struct {
	Name string
	Pid  int
	// Record is the server's record; nil while it is starting (it writes its record
	// once its export is ready).
	Record *Record
	// Status is its last status, nil if it wrote none.
	Status *volume.Status
	// State is what the server is doing: a Status state (serving, degraded, failed,
	// suspended, stopping), StateStarting before it has a record, or StateFrozen when
	// its process is stopped (SIGSTOP, a debugger), which answers nothing until it is
	// continued.
	State string
}

// List finds every server of this state directory that still runs, sorted by name,
// and clears away what dead ones left behind (but the status and log of a failed one).
func (s StateDir) List() ([]Entry, error) {
	ents, err := os.ReadDir(s.Path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read state directory: %w", err)
	}
	seen := map[string]bool{}
	var out []Entry
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			name, ok = strings.CutSuffix(e.Name(), ".lock")
		}
		if !ok || seen[name] || ValidName(name) != nil {
			continue
		}
		seen[name] = true
		rec, _ := s.ReadRecord(name)
		if !s.Alive(name) {
			if l, lerr := s.LockName(name); lerr == nil {
				s.Cleanup(name, rec, false)
				l.Release()
			}
			continue
		}
		out = append(out, s.entry(name, rec))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// entry describes the live server of name.
func (s StateDir) entry(name string, rec *Record) Entry {
	e := Entry{Name: name, Record: rec, Pid: s.lockPID(name)}
	if e.Pid == 0 && rec != nil {
		e.Pid = rec.Pid
	}
	if st, err := s.ReadStatus(name); err == nil && (e.Pid == 0 || st.Pid == e.Pid) {
		e.Status = st
		if e.Pid == 0 {
			e.Pid = st.Pid
		}
	}
	switch {
	case e.Pid != 0 && processStopped(e.Pid):
		e.State = StateFrozen
	case e.Status != nil && e.Status.State == volume.StateStopped:
		e.State = volume.StateStopping // its final status is written; it is letting go
	case e.Status != nil:
		e.State = e.Status.State
	case rec == nil:
		e.State = StateStarting
	default:
		e.State = "unknown"
	}
	return e
}

// processStopped reports whether process pid is stopped (SIGSTOP, a debugger).
func processStopped(pid int) bool {
	s := processState(pid)
	return s == 'T' || s == 't'
}

// ProcessRuns reports whether process pid exists and has not exited (a zombie waits
// only to be reaped).
func ProcessRuns(pid int) bool {
	s := processState(pid)
	return s != 0 && s != 'Z' && s != 'X'
}

// processState is the state letter of process pid in /proc/PID/stat (proc(5)), or 0 if
// there is no such process.
func processState(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// pid (comm) state ...: comm may hold spaces and parentheses; the state follows
	// the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

// Live lists the records of running servers that have one, sorted by name (see List).
func (s StateDir) Live() ([]*Record, error) {
	ents, err := s.List()
	var out []*Record
	for _, e := range ents {
		if e.Record != nil {
			out = append(out, e.Record)
		}
	}
	return out, err
}

// RequestStop tells the server of name how long its shutdown may take: its I/O to the
// provider ends by deadline whatever the storage does (a remote provider's requests are
// cut short; a local disk's I/O cannot be), then it lets go. Send the stop signal after.
func (s StateDir) RequestStop(name string, deadline time.Time) error {
	return s.writeJSON(name, ".stop", stopRequest{Deadline: deadline})
}

type stopRequest struct {
	Deadline time.Time `json:"deadline"`
}

// stopDeadline is the deadline RequestStop gave name's server, or now+def.
func (s StateDir) stopDeadline(name string, def time.Duration) time.Time {
	var r stopRequest
	if err := s.readJSON(name, ".stop", &r); err == nil && !r.Deadline.IsZero() {
		return r.Deadline
	}
	return time.Now().Add(def)
}

// FileID identifies a provider independently of the path used to name it.
func FileID(path string) (dev, ino uint64, err error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, 0, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		return st.Rdev, 0, nil
	}
	return st.Dev, st.Ino, nil
}

// Find resolves what the user typed (a name, or a provider path) to a live server: by
// name whatever its state (a server still starting has a minimal record: its name and
// pid), and by provider among those with a record.
func (s StateDir) Find(arg string) (*Record, error) {
	ents, err := s.List()
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if e.Name == arg {
			if e.Record != nil {
				return e.Record, nil
			}
			return &Record{Name: e.Name, Pid: e.Pid}, nil
		}
	}
	for _, e := range ents {
		if e.Record != nil && e.Record.Provider == arg { // a remote provider, by its URI
			return e.Record, nil
		}
	}
	if dev, ino, err := FileID(arg); err == nil {
		for _, e := range ents {
			if e.Record != nil && e.Record.Dev == dev && e.Record.Ino == ino {
				return e.Record, nil
			}
		}
	}
	return nil, fmt.Errorf("%s is not attached (see 'eli list')", arg)
}

// Serving finds a live server of the volume with this ID, or returns nil.
func (s StateDir) Serving(id [16]byte) *Record {
	recs, _ := s.Live()
	want := hex.EncodeToString(id[:])
	for _, r := range recs {
		if r.VolumeID == want {
			return r
		}
	}
	return nil
}

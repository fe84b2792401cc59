package volume

import (
	"fmt"
	"time"

	"github.com/elidisk/eli/nbdclient"
)

// States of a volume in its Status.
const (
	StateServing = "serving" // attached and answering
	// StateDegraded: serving, but without the protection against rollback its format
	// promises: the witness cannot be written (Status.Witness says why).
	StateDegraded  = "degraded"
	StateFailed    = "failed"    // the provider failed a write or flush (authenticated modes then refuse writes)
	StateStopping  = "stopping"  // shutting down: draining, the final commit, letting go
	StateStopped   = "stopped"   // the server has exited (Status.Final says how)
	StateSuspended = "suspended" // eli suspend: the keys are wiped and requests wait for eli resume
)

// Status is what the server reports about its volume: `eli status`, the state column of
// `eli list`, and the final word `eli detach` reports. Volume.Status fills in the
// volume's state and counters; eli's background server (package internal/daemon) adds
// its name, pid, final outcome and time, and rewrites it in its state directory when it
// changes, at most a few times a second, at once when the volume fails, and a last time
// when it stops.
type Status struct {
	Name  string `json:"name"`
	Pid   int    `json:"pid"`
	Mode  string `json:"mode"`
	State string `json:"state"`
	// Error is the provider failure that stopped the volume (State "failed", or
	// "stopped" after one).
	Error string `json:"error,omitempty"`
	// Final is the outcome of the last commit and flush when the server stopped: "ok",
	// or what failed. Empty while the server runs.
	Final string `json:"final,omitempty"`
	// Witness says why the volume's witness does not hold its latest flushed state
	// (State "degraded" while serving); empty when it does, or the volume has none.
	Witness string `json:"witness,omitempty"`
	// Storage says what is wrong with a remote provider's connections (unreachable, not
	// answering, no longer this volume); empty while they work, and for local ones.
	Storage string `json:"storage,omitempty"`
	// LastFlush is when the last flush the server acknowledged completed.
	LastFlush time.Time `json:"last_flush,omitzero"`
	// SuspendedSince is when the volume was suspended (State "suspended"), and Held
	// how many requests wait for its resume.
	SuspendedSince time.Time `json:"suspended_since,omitzero"`
	Held           int       `json:"held,omitempty"`

	Reads        uint64 `json:"reads"`
	Writes       uint64 `json:"writes"`
	WriteZeroes  uint64 `json:"write_zeroes"`
	Trims        uint64 `json:"trims"`
	Flushes      uint64 `json:"flushes"`
	Caches       uint64 `json:"caches"`
	BytesRead    uint64 `json:"bytes_read"`
	BytesWritten uint64 `json:"bytes_written"`
	AuthFailures uint64 `json:"auth_failures"`
	Commits      uint64 `json:"commits"`
	// Journal is what the attach found in the journal ("replayed" and "torn" are the
	// recoveries of a crash; see blockdev.Recovery), and RecoveredSectors how many
	// sectors it rolled forward or back.
	Journal          string `json:"journal"`
	RecoveredSectors int    `json:"recovered_sectors"`

	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
	Updated     time.Time `json:"updated"`
	// Authenticated says whether the mode keeps a journal: it decides what a failure
	// means for the data.
	Authenticated bool `json:"authenticated"`
	// Reencrypt is the volume's re-encryption: one under way, or one that ended while
	// this server ran; nil otherwise.
	Reencrypt *ReencryptStatus `json:"reencrypt,omitempty"`
}

// Status is a snapshot of v's counters and state. A provider fenced since the last
// write (a remote volume taken over) fails the volume here, without waiting for one.
func (v *Volume) Status() Status {
	v.checkFence()
	st := v.dev.Stats()
	r := v.dev.Recovery()
	s := Status{
		Mode:             v.Mode().String(),
		State:            StateServing,
		AuthFailures:     st.AuthFailures,
		Commits:          st.Commits,
		Journal:          r.Journal,
		RecoveredSectors: r.Sectors,
		Authenticated:    v.Mode().Authenticated(),
		Reencrypt:        v.Reencryption(),
	}
	s.LastFlush = v.LastFlush()
	s.Witness = v.WitnessProblem()
	if s.Witness != "" {
		s.State = StateDegraded
	}
	if v.health != nil {
		s.Storage = describeHealth(v.health())
	}
	if ok, since := v.dev.Suspended(); ok {
		s.State, s.SuspendedSince, s.Held = StateSuspended, since, v.dev.Held()
	}
	v.ops.fill(&s)
	v.faults.fill(&s)
	return s
}

// describeHealth says what is wrong with a remote provider's connections, or "".
func describeHealth(h nbdclient.Health) string {
	switch {
	case h.Broken != nil:
		return "stopped: " + h.Broken.Error()
	case !h.Connected:
		s := "unreachable since " + h.DownSince.Format(time.TimeOnly)
		if h.LastError != nil {
			s += " (" + h.LastError.Error() + ")"
		}
		return s + "; reconnecting"
	case h.Oldest >= slowRequest:
		return fmt.Sprintf("not answering: a request has waited %v", h.Oldest.Round(time.Second))
	case h.Reconnections > 0:
		return fmt.Sprintf("connected; the connection was lost and re-established %d times", h.Reconnections)
	}
	return ""
}

// slowRequest is how long a request to remote storage waits before status calls the
// storage not answering.
const slowRequest = 5 * time.Second

// Failed reports whether the server stopped, or runs, with its data not all safe.
func (s *Status) Failed() bool {
	return s.State == StateFailed || s.Error != "" || (s.Final != "" && s.Final != "ok")
}

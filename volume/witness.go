package volume

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/elidisk/eli/blockdev"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/provider"
)

// A witness is a small file outside the provider that remembers how far a format
// version 2 volume has come: its volume ID and the generation and root of its hash tree
// at the last completed flush. Whoever can write the provider can put back an older
// image of all of it, tree and journal included, and that image is consistent; only
// something the provider's writer cannot reach tells it from the current one. Attach
// refuses a provider older than its witness, accepts a newer one (a crash between the
// provider's flush and the witness's update), and moves the witness forward.
//
// The witness is written after the flush it records has completed, by a goroutine of
// its own, so flushes never wait for it; it may lag behind the provider, never run
// ahead of it.

// RollbackError: the provider is older than its witness (someone put back an older
// image of it), or at the witness's generation with another root (a copy of it was
// written since: a fork).
type RollbackError struct {
	Witness           string
	WitnessGeneration uint64
	Generation        uint64 // the provider's (for a fork, both are the same)
	Fork              bool
	Err               error // blockdev.ErrRolledBack with its details, if it said so
}

func (e *RollbackError) Error() string {
	switch {
	case e.Fork:
		return fmt.Sprintf("the provider is at generation %d as its witness %s says, but with another root: "+
			"a copy of the provider was written since (a fork)", e.Generation, e.Witness)
	case e.Err != nil:
		return fmt.Sprintf("%v (witness %s): someone put back an older image of the provider", e.Err, e.Witness)
	}
	return fmt.Sprintf("%v: the provider is at generation %d, its witness %s at %d: someone put back an older image of the provider",
		blockdev.ErrRolledBack, e.Generation, e.Witness, e.WitnessGeneration)
}

func (e *RollbackError) Unwrap() error { return blockdev.ErrRolledBack }

// WitnessError: the witness file cannot be used to check the volume.
type WitnessError struct {
	Path string
	Kind WitnessErrorKind
	// VolumeID is the volume a Foreign witness belongs to (hex).
	VolumeID string
	Err      error
}

// WitnessErrorKind says what is wrong with a witness file.
type WitnessErrorKind int

const (
	// WitnessUnreadable: the file is there but cannot be read (Err says why).
	WitnessUnreadable WitnessErrorKind = iota
	// WitnessDamaged: the file is not a witness, or a damaged one.
	WitnessDamaged
	// WitnessForeign: the file is another volume's witness.
	WitnessForeign
)

func (e *WitnessError) Error() string {
	switch e.Kind {
	case WitnessDamaged:
		return fmt.Sprintf("witness %s is damaged (%v)", e.Path, e.Err)
	case WitnessForeign:
		return fmt.Sprintf("witness %s belongs to volume %s, not this one", e.Path, e.VolumeID)
	}
	return fmt.Sprintf("witness %s: %v", e.Path, e.Err)
}

func (e *WitnessError) Unwrap() error { return e.Err }

// CheckWitness compares what a format version 2 provider's journal says of its
// generation and root, read without the key (blockdev.PeekFreshness), with its witness,
// before anything is locked or unlocked: a provider clearly older than the witness, or
// a fork, is refused (*RollbackError) without holding the volume for the time of a
// KDF. Open makes the check that counts, on what the key verifies; this one only
// refuses what that one would (the newest slot's generation, even torn, is never below
// the last one completed, which is all a witness ever records). A witness at generation
// 0, written when the volume had never committed, refuses no root: a slot torn in the
// volume's first commit (a copy into the mapping cut at any byte) may read as
// generation 0 with part of a root, which no key verifies and Open ignores.
func CheckWitness(witness string, p provider.Provider, hdr *keys.Header) error {
	if witness == "" || !hdr.Layout.Tree() {
		return nil
	}
	seen, err := readWitness(witness, hdr.VolumeID)
	if err != nil || seen == nil {
		return err
	}
	f, ok, err := blockdev.PeekFreshness(p, hdr.Layout)
	if err != nil {
		return nil // Open says what is wrong with the journal
	}
	switch {
	case !ok && seen.Generation > 0, ok && f.Generation < seen.Generation:
		return &RollbackError{Witness: witness, WitnessGeneration: seen.Generation, Generation: f.Generation}
	case ok && seen.Generation > 0 && f.Generation == seen.Generation && f.Root != seen.Root:
		return &RollbackError{Witness: witness, WitnessGeneration: seen.Generation, Generation: f.Generation, Fork: true}
	}
	return nil
}

// witnessRecord is the witness file's content.
type witnessRecord struct {
	VolumeID   string `json:"volume_id"`
	Generation uint64 `json:"generation"`
	Root       string `json:"root"`
}

// maxWitnessSize bounds what is read from a witness file before it is trusted.
const maxWitnessSize = 4096

// readWitness reads the witness at path for volume id; (nil, nil) when there is none.
func readWitness(path string, id [16]byte) (*blockdev.Freshness, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, &WitnessError{Path: path, Kind: WitnessUnreadable, Err: err}
	}
	defer f.Close()
	b := make([]byte, maxWitnessSize+1)
	n, err := f.Read(b)
	if err != nil && n == 0 {
		return nil, &WitnessError{Path: path, Kind: WitnessUnreadable, Err: err}
	}
	if n > maxWitnessSize {
		return nil, &WitnessError{Path: path, Kind: WitnessDamaged, Err: fmt.Errorf("larger than %d bytes: not a witness", maxWitnessSize)}
	}
	var r witnessRecord
	if err := json.Unmarshal(b[:n], &r); err != nil {
		return nil, &WitnessError{Path: path, Kind: WitnessDamaged, Err: err}
	}
	if r.VolumeID != hex.EncodeToString(id[:]) {
		return nil, &WitnessError{Path: path, Kind: WitnessForeign, VolumeID: r.VolumeID}
	}
	root, err := hex.DecodeString(r.Root)
	if err != nil || len(root) != 32 {
		return nil, &WitnessError{Path: path, Kind: WitnessDamaged, Err: fmt.Errorf("root %q", r.Root)}
	}
	w := &blockdev.Freshness{Generation: r.Generation}
	copy(w.Root[:], root)
	return w, nil
}

// writeWitness replaces the witness at path with f, durably: a crash leaves the old
// witness or the new one, never a torn one.
func writeWitness(path string, id [16]byte, f blockdev.Freshness) error {
	b, err := json.Marshal(witnessRecord{VolumeID: hex.EncodeToString(id[:]), Generation: f.Generation, Root: hex.EncodeToString(f.Root[:])})
	if err != nil {
		return err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after a successful rename, there is nothing to remove
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// witness keeps a witness file up to date from a volume's flushes.
type witness struct {
	path string
	id   [16]byte
	log  *slog.Logger
	seen *blockdev.Freshness // what the file held when the volume opened (nil: no file)

	mu      sync.Mutex
	latest  blockdev.Freshness // the newest flushed state reported
	written uint64             // the generation the file holds (0: none written yet)
	err     error              // the last write's failure, until a write succeeds
	writes  int                // files written, for tests
	kick    chan struct{}
	done    chan struct{}
	stopped chan struct{}
}

func newWitness(path string, id [16]byte, log *slog.Logger) *witness {
	w := &witness{path: path, id: id, log: log, kick: make(chan struct{}, 1), done: make(chan struct{}), stopped: make(chan struct{})}
	go w.run()
	return w
}

// openWitness reads the witness at path of volume id before the volume's device opens,
// and starts the writer that will follow its flushes.
func openWitness(path string, id [16]byte, log *slog.Logger) (*witness, error) {
	seen, err := readWitness(path, id)
	if err != nil {
		return nil, err
	}
	w := newWitness(path, id, log)
	w.seen = seen
	return w, nil
}

// minGeneration is the generation below which the device refuses the provider: the one
// the witness held, unless a rollback is accepted.
func (w *witness) minGeneration(acceptRollback bool) uint64 {
	if w.seen == nil || acceptRollback {
		return 0
	}
	return w.seen.Generation
}

// attach checks what the opened device verified (f) against what the witness held: a
// fork (the same generation past 0 with another root; at generation 0 the volume had
// never committed, and there is nothing to fork) is refused unless a rollback is
// accepted; a provider older than the witness has been refused by the device already.
// It then records f and writes it at once, so that a witness that cannot be written is
// known at attach, not found in a log later; warnings are for the user.
func (w *witness) attach(f blockdev.Freshness, acceptRollback bool) (warnings []string, err error) {
	seen := w.seen
	switch {
	case seen == nil && f.Generation > 0:
		warnings = append(warnings, fmt.Sprintf("no witness of this volume on this host (%s), though it has been written (generation %d): "+
			"the provider is trusted as it is, so an older image put back would not have been noticed this time; "+
			"its witness starts now. If this host attached the volume before, its witness was lost: "+
			"check that the data is what you expect", w.path, f.Generation))
		w.log.Warn("no witness: the provider is trusted as it is", "witness", w.path, "generation", f.Generation)
	case seen == nil:
	case !acceptRollback && seen.Generation > 0 && f.Generation == seen.Generation && f.Root != seen.Root:
		return nil, &RollbackError{Witness: w.path, WitnessGeneration: seen.Generation, Generation: f.Generation, Fork: true}
	case f.Generation > seen.Generation:
		w.log.Info("provider newer than its witness: a flush that the witness had not recorded yet", "witness", w.path,
			"witness_generation", seen.Generation, "generation", f.Generation)
	case acceptRollback && f.Generation < seen.Generation:
		w.log.Warn("rollback accepted: the witness is reset to the provider", "witness", w.path,
			"witness_generation", seen.Generation, "generation", f.Generation)
	}
	w.record(f.Generation, f.Root)
	if err := w.writeNow(); err != nil {
		warnings = append(warnings, witnessProblem(w.path, err))
	}
	return warnings, nil
}

// record notes a completed flush's state; the file follows shortly.
func (w *witness) record(gen uint64, root [32]byte) {
	w.mu.Lock()
	if gen >= w.latest.Generation {
		w.latest = blockdev.Freshness{Generation: gen, Root: root}
	}
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// witnessPace is the least time between two writes of the witness file. A client that
// flushes after every write (a database's commits) flushes thousands of times a second,
// and writing the witness each time, two fsyncs and a rename, costs a large share of the
// server's CPU on tmpfs (docs/benchmarks.md, "Measurements behind design choices") and
// would double the flushes a disk sees. Paced, the witness lags the provider by at most
// about witnessPace and one write of the file: the "last moments before a crash" whose
// rollback goes unnoticed (docs/threat-model.md). Close writes the latest state at once.
const witnessPace = 100 * time.Millisecond

func (w *witness) run() {
	defer close(w.stopped)
	pace := time.NewTimer(witnessPace)
	pace.Stop()
	for {
		select {
		case <-w.kick:
		case <-w.done:
			return
		}
		w.flush()
		pace.Reset(witnessPace)
		select {
		case <-pace.C:
		case <-w.done:
			return
		}
	}
}

// flush writes the latest state if the file does not hold it yet.
func (w *witness) flush() error {
	w.mu.Lock()
	f := w.latest
	if f.Generation == 0 || f.Generation == w.written {
		err := w.err
		w.mu.Unlock()
		return err
	}
	w.mu.Unlock()
	err := writeWitness(w.path, w.id, f)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		if w.err == nil {
			w.log.Error("witness not updated: a rollback of the provider to this state would go unnoticed", "witness", w.path, "generation", f.Generation, "err", err)
		}
		w.err = err
		return err
	}
	w.written, w.err = f.Generation, nil
	w.writes++
	return nil
}

// writeNow writes the latest state at once, even a volume's first (generation 0), so
// that a witness that cannot be written is known at attach.
func (w *witness) writeNow() error {
	w.mu.Lock()
	f := w.latest
	w.mu.Unlock()
	err := writeWitness(w.path, w.id, f)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		w.err = err
		return err
	}
	if f.Generation >= w.written {
		w.written, w.err = f.Generation, nil
	}
	w.writes++
	return nil
}

// failure is why the file does not hold the latest state reported, or nil.
func (w *witness) failure() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// close stops the writer and writes the latest state one last time, returning whether
// the file holds it.
func (w *witness) close() error {
	close(w.done)
	<-w.stopped
	return w.flush()
}

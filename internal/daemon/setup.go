package daemon

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/volume"
)

// The background server is a child process that inherits the locked provider and name
// lock. It learns what to serve through a setup pipe (WriteSetup, ReadSetup), so that the
// master key never passes through argv or the environment, and says when it is ready, or
// why it failed, on a ready pipe (WriteReady, ReadReady).

// Setup is what the background server is started with: its volume.Config and what
// only eli's own server needs. Like the Config it holds no secret; WriteSetup sends it
// as one JSON object, the Config's fields and these side by side.
type Setup struct {
	volume.Config
	// LogFile is the server's log, NAME.log in the state directory.
	LogFile string `json:"log_file,omitempty"`
	// Owner is the instance ID of the ownership mark attach took on a remote provider,
	// which the server adopts and heartbeats (package remote); empty for local ones.
	Owner string `json:"owner,omitempty"`
	// KeepBusyDevice: when Run stops, a kernel device still in use (a file system that
	// could not be unmounted) is left connected (volume.Server.KeepDeviceIfBusy), for a
	// new server to re-plug, instead of being pulled from under its users. 'eli attach
	// --foreground' sets it: a supervisor's stop or restart is not 'eli detach', which
	// refuses a device in use before it asks the server to stop.
	KeepBusyDevice bool `json:"keep_busy_device,omitempty"`
}

// maxSetup bounds the config a child accepts; a real one is well under 1 KiB.
const maxSetup = 64 << 10

// WriteSetup sends cfg and the master key: a big-endian u32 length, the setup as JSON,
// then the key's bytes.
func WriteSetup(w io.Writer, cfg *Setup, mk *keys.MasterKey) error {
	conf, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	if len(conf) > maxSetup {
		return fmt.Errorf("setup of %d bytes is too large", len(conf))
	}
	msg := binary.BigEndian.AppendUint32(nil, uint32(len(conf)))
	msg = append(msg, conf...)
	msg = append(msg, mk.Bytes()...)
	_, err = w.Write(msg)
	clear(msg)
	return err
}

// ReadSetup reads what WriteSetup sent and closes r.
func ReadSetup(r io.ReadCloser) (*Setup, *keys.MasterKey, error) {
	defer r.Close()
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return nil, nil, fmt.Errorf("read setup: %w", err)
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > maxSetup {
		return nil, nil, fmt.Errorf("setup of %d bytes is implausible", size)
	}
	conf := make([]byte, size)
	if _, err := io.ReadFull(r, conf); err != nil {
		return nil, nil, fmt.Errorf("read setup: %w", err)
	}
	cfg := &Setup{}
	if err := json.Unmarshal(conf, cfg); err != nil {
		return nil, nil, fmt.Errorf("read setup: %w", err)
	}
	key := keys.NewSecret(keys.MasterKeySize)
	defer key.Wipe()
	if _, err := io.ReadFull(r, key.Bytes()); err != nil {
		return nil, nil, fmt.Errorf("read key: %w", err)
	}
	mk, err := keys.NewMasterKey(cfg.VolumeID, key.Bytes())
	if err != nil {
		return nil, nil, err
	}
	if cfg.Onetime && !cfg.Mode.Valid() {
		mk.Wipe()
		return nil, nil, fmt.Errorf("setup names an invalid mode")
	}
	return cfg, mk, nil
}

type readyMsg struct {
	Record *Record `json:"record,omitempty"`
	Error  string  `json:"error,omitempty"`
}

// WriteReady reports the running server's record, or (rec nil) why it could not start,
// as one JSON line, and closes w. A child that failed calls it only once it has let go
// of the provider and the name, so that the attach that reports the failure leaves
// both free.
func WriteReady(w io.WriteCloser, rec *Record, failure error) error {
	m := readyMsg{Record: rec}
	if failure != nil {
		m.Error = failure.Error()
	}
	b, _ := json.Marshal(m)
	_, err := w.Write(append(b, '\n'))
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	return err
}

// ErrNoReady: the child exited, or closed the pipe, without a word.
var ErrNoReady = errors.New("server exited before it was ready")

// ReadReady waits for the child's ready message: its record, or its failure.
func ReadReady(r io.Reader) (*Record, error) {
	line, err := io.ReadAll(io.LimitReader(r, maxSetup))
	var m readyMsg
	if err != nil || json.Unmarshal(line, &m) != nil {
		return nil, ErrNoReady
	}
	if m.Error != "" {
		return nil, errors.New(m.Error)
	}
	if m.Record == nil {
		return nil, errors.New("server said it was ready but sent no record")
	}
	return m.Record, nil
}

package daemon

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"reflect"
	"testing"
	"time"

	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
)

// TestSetupRoundTrip: what attach sends its server arrives whole, the volume's config
// and the server's own settings as one flat JSON object (the format the server reads),
// the key after it; a length past the bound is refused before anything is read.
func TestSetupRoundTrip(t *testing.T) {
	t.Parallel()
	mk := generateKey(t)
	defer mk.Wipe()
	in := &Setup{
		Config: volume.Config{Name: "v", Provider: "/p", Socket: "/s", Onetime: true, Mode: sector.Default, SectorSize: 4096,
			VolumeID: mk.VolumeID(), RemoteQueueTimeout: -1, RemoteInterval: 300 * time.Millisecond},
		LogFile: "/l", Owner: "abc", KeepBusyDevice: true,
	}
	var buf bytes.Buffer
	if err := WriteSetup(&buf, in, mk); err != nil {
		t.Fatal(err)
	}
	msg := buf.Bytes()
	n := binary.BigEndian.Uint32(msg)
	var flat map[string]any
	if err := json.Unmarshal(msg[4:4+n], &flat); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"name", "log_file", "owner", "keep_busy_device", "remote_interval"} {
		if _, ok := flat[k]; !ok {
			t.Errorf("the setup's JSON has no top-level %q: %v", k, flat)
		}
	}
	if !bytes.Equal(msg[4+n:], mk.Bytes()) {
		t.Error("the key does not follow the JSON")
	}
	out, got, err := ReadSetup(io.NopCloser(bytes.NewReader(msg)))
	if err != nil {
		t.Fatal(err)
	}
	defer got.Wipe()
	if !reflect.DeepEqual(out, in) || !bytes.Equal(got.Bytes(), mk.Bytes()) || got.VolumeID() != mk.VolumeID() {
		t.Errorf("read back %+v, want %+v", out, in)
	}

	huge := binary.BigEndian.AppendUint32(nil, maxSetup+1)
	if _, _, err := ReadSetup(io.NopCloser(bytes.NewReader(huge))); err == nil {
		t.Error("a setup longer than its bound was accepted")
	}
}

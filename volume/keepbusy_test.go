package volume

import (
	"context"
	"errors"
	"testing"
)

// TestKeepIfBusy: a server stopped by its supervisor leaves a kernel device that is in
// use (or whose use cannot be told) connected, and disconnects an idle one.
func TestKeepIfBusy(t *testing.T) {
	for _, tc := range []struct {
		name       string
		why        string
		err        error
		disconnect bool
	}{
		{"idle", "", nil, true},
		{"mounted", "mounted on /srv", nil, false},
		{"unknown", "", errors.New("no /proc"), false},
	} {
		old := inUse
		var asked []int
		inUse = func(i int) (string, error) { asked = append(asked, i); return tc.why, tc.err }
		var calls []int
		srv := kernelTestServer(t, &calls)
		srv.KeepDeviceIfBusy()
		if err := srv.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		inUse = old
		if len(asked) != 1 || asked[0] != 3 {
			t.Errorf("%s: asked about devices %v, want 3", tc.name, asked)
		}
		if got := len(calls) == 1; got != tc.disconnect {
			t.Errorf("%s: disconnect calls %v; want a disconnect: %v", tc.name, calls, tc.disconnect)
		}
	}
}

package main

import (
	"strings"
	"testing"

	"github.com/elidisk/eli/volume"
)

// TestStatusProblem: a status says something failed exactly when the provider failed or
// the final commit did, in one line that names the error and what the data is worth.
func TestStatusProblem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		st   volume.Status
		want []string // in Problem; none: nothing failed
	}{
		{"serving", volume.Status{State: volume.StateServing}, nil},
		{"clean stop", volume.Status{State: volume.StateStopped, Final: "ok"}, nil},
		{"failed while serving", volume.Status{State: volume.StateFailed, Error: "ENOSPC", Authenticated: true},
			[]string{"provider failed: ENOSPC", "journal"}},
		{"failed, then the final commit with it", volume.Status{State: volume.StateStopped, Error: "ENOSPC", Final: "ENOSPC", Authenticated: true},
			[]string{"final commit could not be made: ENOSPC", "journal"}},
		{"failed, final sync fine (no journal)", volume.Status{State: volume.StateStopped, Error: "EIO", Final: "ok"},
			[]string{"provider failed: EIO", "no journal"}},
		{"only the final commit", volume.Status{State: volume.StateStopped, Final: "sync: EIO", Authenticated: true},
			[]string{"final commit and flush failed: sync: EIO"}},
		{"two failures", volume.Status{State: volume.StateStopped, Error: "ENOSPC", Final: "EIO", Authenticated: true},
			[]string{"(ENOSPC)", "failed too: EIO"}},
	} {
		st := tc.st
		st.Name = "v"
		msg := problem(&st)
		if st.Failed() != (tc.want != nil) || (msg != "") != (tc.want != nil) {
			t.Errorf("%s: Failed %v, problem %q", tc.name, st.Failed(), msg)
			continue
		}
		for _, w := range append(tc.want, "v: ", "flushed before the failure is safe") {
			if tc.want != nil && !strings.Contains(msg, w) {
				t.Errorf("%s: %q lacks %q", tc.name, msg, w)
			}
		}
		if strings.Contains(msg, "\n") {
			t.Errorf("%s: more than one line: %q", tc.name, msg)
		}
	}
}

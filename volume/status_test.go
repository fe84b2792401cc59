package volume

import (
	"strings"
	"testing"
)

// TestStatusProblem: a status says something failed exactly when the provider failed or
// the final commit did, in one line that names the error and what the data is worth.
func TestStatusProblem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		st   Status
		want []string // in Problem; none: nothing failed
	}{
		{"serving", Status{State: StateServing}, nil},
		{"clean stop", Status{State: StateStopped, Final: "ok"}, nil},
		{"failed while serving", Status{State: StateFailed, Error: "ENOSPC", Authenticated: true},
			[]string{"provider failed: ENOSPC", "journal"}},
		{"failed, then the final commit with it", Status{State: StateStopped, Error: "ENOSPC", Final: "ENOSPC", Authenticated: true},
			[]string{"final commit could not be made: ENOSPC", "journal"}},
		{"failed, final sync fine (no journal)", Status{State: StateStopped, Error: "EIO", Final: "ok"},
			[]string{"provider failed: EIO", "no journal"}},
		{"only the final commit", Status{State: StateStopped, Final: "sync: EIO", Authenticated: true},
			[]string{"final commit and flush failed: sync: EIO"}},
		{"two failures", Status{State: StateStopped, Error: "ENOSPC", Final: "EIO", Authenticated: true},
			[]string{"(ENOSPC)", "failed too: EIO"}},
	} {
		st := tc.st
		st.Name = "v"
		msg := st.Problem()
		if st.Failed() != (tc.want != nil) || (msg != "") != (tc.want != nil) {
			t.Errorf("%s: Failed %v, Problem %q", tc.name, st.Failed(), msg)
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

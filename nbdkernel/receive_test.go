package nbdkernel

import "testing"

// TestReceiveLoops counts the kernel threads running a device's receive work, as Linux
// names them: a worker's name ends in +<workqueue> while it runs an item of it, a
// rescuer is named after its workqueue and gains the same suffix while it runs one.
func TestReceiveLoops(t *testing.T) {
	t.Parallel()
	h := fakeHost(t, map[string]string{
		"proc/10/comm":   "kworker/u5:0+nbd0-recv\n",
		"proc/11/comm":   "nbd0-recv+nbd0-recv\n",
		"proc/12/comm":   "kworker/u5:1-nbd0-recv\n", // ran one, idle now
		"proc/13/comm":   "nbd0-recv\n",              // another rescuer, idle
		"proc/14/comm":   "kworker/u5:2+nbd10-recv\n",
		"proc/15/comm":   "sh\n",
		"proc/self/comm": "kworker/u5:0+nbd0-recv\n", // not a pid: not counted twice
		"proc/16/status": "no comm: the process ended\n",
	})
	for _, tc := range []struct{ idx, want int }{{0, 2}, {10, 1}, {1, 0}} {
		got, err := h.receiveLoops(tc.idx)
		if err != nil || got != tc.want {
			t.Errorf("receiveLoops(%d) = %d, %v; want %d", tc.idx, got, err, tc.want)
		}
	}
	if _, err := (host{proc: t.TempDir() + "/none"}).receiveLoops(0); err == nil {
		t.Error("receiveLoops with no process list: no error")
	}
}

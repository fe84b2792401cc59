package integration

import (
	_ "embed"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
)

//go:embed vm/recvstarve.sh
var recvStarveScript []byte

// TestVMReceiveStarvation checks what eli says of a kernel that reads only some of a
// device's connections, on Debian's 6.1 kernel under TCG: why a device with several
// connections can have a request timed out at 30 s while eli answered it in milliseconds
// (docs/benchmarks.md, "Boot to mounted"). The driver runs each connection's receive
// loop, which returns only when its socket dies, as a work item of the device's
// workqueue; when the pool has no idle worker and creating one is slow, the workqueue's
// rescuer takes every pending item of the device and runs them one after another, so
// the second loop waits behind the first and replies on that connection go unread until
// the kernel times the request out and moves it to the other connection. The guest
// slows thread creation for the first attach after boot, which starves a loop in most
// runs (not all: the kernel may still create the worker in time), then attaches again
// with workers idle. In every round, eli's server warns exactly when the kernel runs
// fewer loops than connections (volume's checkReceiving); a starved round has a request
// time out, a round with every loop running has none; and with one connection, the loop
// always runs (on the rescuer or a worker) and nothing times out.
func TestVMReceiveStarvation(t *testing.T) {
	g := newGuest(t, recvStarveScript, "")
	for _, conns := range []int{2, 1} {
		t.Run(fmt.Sprintf("connections=%d", conns), func(t *testing.T) {
			console, res := g.boot(t, fmt.Sprintf("eli.connections=%d", conns), 9*time.Minute)
			defer func() {
				if t.Failed() {
					t.Logf("the server's log and the kernel's nbd lines, from the guest:\n%s", serverLog(console))
				}
			}()
			get := func(key string) string { return strings.Join(res[key], " ") }
			num := func(key string) int {
				n, err := strconv.Atoi(get(key))
				if err != nil {
					t.Errorf("%s = %q: %v", key, get(key), err)
				}
				return n
			}
			if _, ok := res["watchdog"]; ok {
				t.Fatalf("the guest's watchdog fired: a step hung")
			}
			for _, round := range []string{"slow", "again"} {
				key := func(k string) string { return round + "_" + k }
				if v := get(key("attach_rc")); v != "0" {
					t.Fatalf("%s = %q, want 0", key("attach_rc"), v)
				}
				for _, k := range []string{"read_failed", "detach_failed"} {
					if v, ok := res[key(k)]; ok {
						t.Errorf("%s %v", key(k), v)
					}
				}
				receiving, warned, timeouts := num(key("receiving")), num(key("warned")), num(key("timeouts"))
				starved := receiving < conns
				t.Logf("%s attach: %d of %d connections received (rescuer: %s), %d timeouts, slowest read %s s", round, receiving, conns, get(key("rescuer")), timeouts, get(key("slowest_read")))
				if want := map[bool]int{true: 1, false: 0}[starved]; warned != want {
					t.Errorf("%s attach: eli warned %d times with %d of %d connections received, want %d", round, warned, receiving, conns, want)
				}
				switch {
				case conns == 1 && starved:
					t.Errorf("%s attach: the one connection's receive loop did not run", round)
				case starved && timeouts == 0:
					t.Errorf("%s attach: a loop starved but no read timed out (read on each CPU)", round)
				case !starved && (timeouts != 0 || num(key("slowest_read")) >= 25):
					t.Errorf("%s attach: every loop ran, yet %d requests timed out and the slowest read took %s s", round, timeouts, get(key("slowest_read")))
				}
			}
			if num("again_receiving") != conns {
				t.Errorf("second attach, with workers idle: %d of %d connections received", num("again_receiving"), conns)
			}
		})
	}
}

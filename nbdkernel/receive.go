package nbdkernel

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Linux's nbd driver reads each connection's replies in a receive loop that returns only
// when the connection's socket dies, run as a work item of the device's workqueue
// (nbd%d-recv). On a kernel whose workqueue rescuer takes all of a workqueue's pending
// items at once and runs them one after another (Linux 6.1; fixed upstream by commit
// e5a30c303b07, "workqueue: Process rescuer work items one-by-one using a cursor"), a
// device connected while the kernel is slow to create a worker thread can have its
// loops queued behind one that never ends: the kernel then reads nothing on those
// connections, and each request it sends there waits for its request timeout before it
// moves to a connection it reads (integration: TestVMReceiveStarvation).

// ReceiveLoops is how many of /dev/nbd<idx>'s receive loops the kernel runs now: the
// kernel threads whose name says they are running a work item of the device's receive
// workqueue (a worker's name ends in "+nbd<idx>-recv" while it runs one, the rescuer's
// too). A connected device whose count stays below its connections has loops that never
// started.
func ReceiveLoops(idx int) (int, error) { return realHost.receiveLoops(idx) }

func (h host) receiveLoops(idx int) (int, error) {
	ents, err := os.ReadDir(h.proc)
	if err != nil {
		return 0, fmt.Errorf("nbdkernel: list processes: %w", err)
	}
	suffix := fmt.Sprintf("+nbd%d-recv", idx)
	n := 0
	for _, e := range ents {
		if name := e.Name(); name == "" || name[0] < '0' || name[0] > '9' {
			continue
		}
		// A process that ended meanwhile has no name to read.
		if b, err := os.ReadFile(filepath.Join(h.proc, e.Name(), "comm")); err == nil && strings.HasSuffix(strings.TrimSpace(string(b)), suffix) {
			n++
		}
	}
	return n, nil
}

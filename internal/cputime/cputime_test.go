package cputime

import (
	"runtime"
	"testing"
	"time"
)

func TestProcessGrowsWithWork(t *testing.T) {
	if runtime.GOOS == "windows" || runtime.GOOS == "plan9" {
		t.Skip("not measured on this system")
	}
	// Work until the process has used 10 ms of CPU, or fail after 10 s of wall time: on a
	// loaded machine 50 ms of wall time may give this process only a few ms of CPU.
	before := Process()
	x := uint64(1)
	for deadline := time.Now().Add(10 * time.Second); Process()-before < 10*time.Millisecond; {
		if time.Now().After(deadline) {
			t.Fatalf("10 s of busy work moved CPU time from %v to %v (x=%d)", before, Process(), x)
		}
		for i := 0; i < 100000; i++ {
			x = x*6364136223846793005 + 1442695040888963407
		}
	}
}

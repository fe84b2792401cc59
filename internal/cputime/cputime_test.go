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
	before := Process()
	x := uint64(1)
	for deadline := time.Now().Add(50 * time.Millisecond); time.Now().Before(deadline); {
		for i := 0; i < 1000; i++ {
			x = x*6364136223846793005 + 1442695040888963407
		}
	}
	if after := Process(); after <= before || after-before < 10*time.Millisecond {
		t.Fatalf("50 ms of busy work moved CPU time from %v to %v (x=%d)", before, after, x)
	}
}

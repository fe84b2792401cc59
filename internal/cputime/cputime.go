// Package cputime reads the CPU time the process has used, for benchmarks that report
// cost per operation in CPU time as well as wall time: on a shared machine the first is
// much steadier than the second.
package cputime

import "time"

// Process is the CPU time (user + system) this process has used so far, or 0 where it
// cannot be measured (benchmarks then report wall time only).
func Process() time.Duration { return process() }

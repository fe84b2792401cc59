//go:build !unix

package sector

import "time"

// lpProcessCPU is not measured here; benchmarks then report wall time only.
func lpProcessCPU() time.Duration { return 0 }

//go:build race

package nbd

// raceEnabled: the race detector slows large copies so much that throughput-shaped
// assertions (limits actually reached) do not hold; upper bounds are still checked.
const raceEnabled = true

//go:build race

package blockdev

// raceEnabled: the race detector slows the single-threaded crash checks tenfold without
// finding anything more in them, so they check fewer points under it.
const raceEnabled = true

//go:build race

package sector

// aeadRace: under the race detector sync.Pool drops items on purpose, so allocation
// counts mean nothing there.
const aeadRace = true

//go:build race

package aesxts

// raceEnabled: under the race detector sync.Pool drops items on purpose, so
// x/crypto/xts (the generic engine) allocates its tweak buffer on every call.
const raceEnabled = true

//go:build race || purego

package sector

// allocsUnmeasurable says why allocation counts mean nothing in this build: under the
// race detector sync.Pool drops items on purpose, and under purego x/crypto's generic
// chacha20poly1305 allocates inside Seal and Open.
const allocsUnmeasurable = "allocation counts are not meaningful under -race or -tags purego"

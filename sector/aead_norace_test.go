//go:build !race

package sector

const aeadRace = false

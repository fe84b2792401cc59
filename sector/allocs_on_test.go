//go:build !race && !purego

package sector

const allocsUnmeasurable = ""

//go:build !race

package aesxts

const raceEnabled = false

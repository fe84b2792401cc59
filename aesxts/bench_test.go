package aesxts

import (
	"strconv"
	"testing"
)

// cpuLoop runs f for b.N ops and reports, beside wall time, CPU time per op and the
// throughput it gives: on a shared machine wall time includes time spent descheduled,
// and `openssl speed` divides by CPU time too (unless -elapsed).
func cpuLoop(b *testing.B, size int, f func()) {
	b.SetBytes(int64(size))
	b.ReportAllocs()
	start := processCPU()
	for b.Loop() {
		f()
	}
	if cpu := processCPU() - start; cpu > 0 {
		ns := float64(cpu.Nanoseconds()) / float64(b.N)
		b.ReportMetric(ns, "cpu-ns/op")
		b.ReportMetric(float64(size)/ns*1e3, "cpu-MB/s")
	}
}

var keyNames = map[int]string{32: "AES-128-XTS", 64: "AES-256-XTS"}

// BenchmarkEngines encrypts and decrypts one data unit per op, each at a new index (a
// tweak encryption per op, as per sector), on every engine this machine has; "generic"
// is golang.org/x/crypto/xts.
func BenchmarkEngines(b *testing.B) {
	for _, keySize := range []int{64, 32} {
		for _, size := range []int{512, 4096} {
			for _, dir := range []string{"enc", "dec"} {
				for _, e := range engines() {
					name := keyNames[keySize] + "/" + dir + "/" + e.String() + "/" + strconv.Itoa(size)
					b.Run(name, func(b *testing.B) {
						c := mustCipher(b, make([]byte, keySize), e)
						op := c.Encrypt
						if dir == "dec" {
							op = c.Decrypt
						}
						buf := make([]byte, size)
						index := uint64(0)
						cpuLoop(b, size, func() {
							op(buf, buf, index)
							index++
						})
					})
				}
			}
		}
	}
}

// BenchmarkSectors encrypts a 64 KiB run of consecutive sectors per op with one
// EncryptSectors call (what sector's Runner does for blockdev), on every engine;
// "generic" is golang.org/x/crypto/xts sector by sector.
func BenchmarkSectors(b *testing.B) {
	const run = 64 << 10
	for _, keySize := range []int{64, 32} {
		for _, size := range []int{512, 4096} {
			for _, e := range engines() {
				b.Run(keyNames[keySize]+"/"+e.String()+"/"+strconv.Itoa(size), func(b *testing.B) {
					c := mustCipher(b, make([]byte, keySize), e)
					buf := make([]byte, run)
					first := uint64(0)
					cpuLoop(b, run, func() {
						c.EncryptSectors(buf, buf, size, first)
						first += run / uint64(size)
					})
				})
			}
		}
	}
}

package cputime

import "testing"

// Loop runs f for b.N ops of size bytes each and reports, beside wall time and
// allocations, CPU time per op and the throughput it gives: on a shared machine wall
// time includes time spent descheduled, and `openssl speed` divides by CPU time too
// (unless -elapsed).
func Loop(b *testing.B, size int, f func()) {
	b.SetBytes(int64(size))
	b.ReportAllocs()
	start := Process()
	for b.Loop() {
		f()
	}
	if cpu := Process() - start; cpu > 0 {
		ns := float64(cpu.Nanoseconds()) / float64(b.N)
		b.ReportMetric(ns, "cpu-ns/op")
		b.ReportMetric(float64(size)/ns*1e3, "cpu-MB/s")
	}
}

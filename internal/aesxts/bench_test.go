package aesxts

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/cputime"
)

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
						cputime.Loop(b, size, func() {
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
					cputime.Loop(b, run, func() {
						c.EncryptSectors(buf, buf, size, first)
						first += run / uint64(size)
					})
				})
			}
		}
	}
}

// BenchmarkOpenSSL runs `openssl speed -evp aes-256-xts -bytes N -seconds 1` (and
// aes-128-xts) per op, one thread, and reports what it measured in the columns the other
// benchmarks use: ns/op and cpu-ns/op are OpenSSL's user CPU time per N-byte call
// (`openssl speed` divides by CPU time unless told -elapsed), cpu-MB/s its throughput.
// Each call is one data unit with its own tweak encryption, as in BenchmarkEngines.
func BenchmarkOpenSSL(b *testing.B) {
	path, err := exec.LookPath("openssl")
	if err != nil {
		b.Skip("no openssl command on PATH")
	}
	for _, keySize := range []int{64, 32} {
		evp := strings.ToLower(keyNames[keySize])
		for _, size := range []int{512, 4096} {
			b.Run(keyNames[keySize]+"/"+strconv.Itoa(size), func(b *testing.B) {
				var bytesPerSec float64
				runs := 0
				for b.Loop() {
					out, err := exec.Command(path, "speed", "-evp", evp, "-bytes", strconv.Itoa(size), "-seconds", "1", "-mr").Output()
					if err != nil {
						b.Fatalf("openssl speed -evp %s: %v", evp, err)
					}
					bps, err := parseSpeed(out)
					if err != nil {
						b.Fatalf("openssl speed -evp %s: %v\n%s", evp, err, out)
					}
					bytesPerSec += bps
					runs++
				}
				ns := float64(size) / (bytesPerSec / float64(runs)) * 1e9
				b.ReportMetric(ns, "ns/op")
				b.ReportMetric(ns, "cpu-ns/op")
				b.ReportMetric(float64(size)/ns*1e3, "cpu-MB/s")
			})
		}
	}
}

// parseSpeed returns the bytes per second of the "+F:id:name:rate" line of `openssl
// speed -mr` output for one block size.
func parseSpeed(out []byte) (float64, error) {
	s := bufio.NewScanner(bytes.NewReader(out))
	for s.Scan() {
		f := strings.Split(s.Text(), ":")
		if len(f) == 4 && f[0] == "+F" {
			v, err := strconv.ParseFloat(f[3], 64)
			if err != nil || v <= 0 {
				return 0, fmt.Errorf("bad rate %q in %q", f[3], s.Text())
			}
			return v, nil
		}
	}
	return 0, errors.New("no +F line in the output")
}

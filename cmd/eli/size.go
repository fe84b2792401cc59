package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// parseSize reads a byte count: plain digits, or digits with a K, M, G, T or P suffix
// (powers of 1024; an optional trailing "B" or "iB" is accepted: 1G = 1GB = 1GiB).
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	u := strings.ToUpper(t)
	u = strings.TrimSuffix(u, "IB")
	if strings.HasSuffix(u, "B") && len(u) > 1 && !isDigit(u[len(u)-2]) {
		u = u[:len(u)-1]
	}
	mult := int64(1)
	if n := len(u); n > 0 {
		if i := strings.IndexByte("KMGTP", u[n-1]); i >= 0 {
			mult = int64(1) << (10 * (i + 1))
			u = u[:n-1]
		} else if u[n-1] == 'B' {
			u = u[:n-1]
		}
	}
	if u == "" || !isAllDigits(u) {
		return 0, fmt.Errorf("invalid size %q (use bytes or a K/M/G/T/P suffix, e.g. 1G)", s)
	}
	v, err := strconv.ParseInt(u, 10, 64)
	if err != nil || v > math.MaxInt64/mult {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return v * mult, nil
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func isAllDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if !isDigit(s[i]) {
			return false
		}
	}
	return true
}

// formatSize prints n in the largest binary unit that divides it, or with one decimal.
func formatSize(n int64) string {
	const units = "KMGTP"
	if n < 1024 {
		return fmt.Sprintf("%d B", n)
	}
	f := float64(n)
	i := -1
	for f >= 1024 && i < len(units)-1 {
		f /= 1024
		i++
	}
	if f == math.Trunc(f) {
		return fmt.Sprintf("%.0f %ciB", f, units[i])
	}
	return fmt.Sprintf("%.1f %ciB", f, units[i])
}

package main

import "testing"

func TestParseSize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true},
		{"4096", 4096, true},
		{"1K", 1024, true},
		{"1k", 1024, true},
		{"64M", 64 << 20, true},
		{"1G", 1 << 30, true},
		{"1GiB", 1 << 30, true},
		{"1GB", 1 << 30, true},
		{"2T", 2 << 40, true},
		{"512B", 512, true},
		{" 3M ", 3 << 20, true},
		{"", 0, false},
		{"G", 0, false},
		{"1.5G", 0, false},
		{"-1G", 0, false},
		{"1X", 0, false},
		{"99999999999P", 0, false},
		{"9223372036854775807", 9223372036854775807, true},
		{"9223372036854775808", 0, false},
	} {
		got, err := parseSize(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestFormatSize(t *testing.T) {
	t.Parallel()
	for in, want := range map[int64]string{
		100:      "100 B",
		1024:     "1 KiB",
		64 << 20: "64 MiB",
		1536:     "1.5 KiB",
		3 << 40:  "3 TiB",
	} {
		if got := formatSize(in); got != want {
			t.Errorf("formatSize(%d) = %q, want %q", in, got, want)
		}
	}
}

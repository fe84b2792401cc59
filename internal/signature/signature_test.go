package signature

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/testtool"
)

// TestDetectRealFormats: each format made by its own tool is named. The tools are in
// scripts/test's install list.
func TestDetectRealFormats(t *testing.T) {
	t.Parallel()
	type tool struct{ prog, pkg string }
	for _, tc := range []struct {
		want string
		need []tool
		make func(t *testing.T, img string)
	}{
		{"an ext2 filesystem", []tool{{"mkfs.ext2", "e2fsprogs"}}, func(t *testing.T, img string) { run(t, "mkfs.ext2", "-q", "-F", img) }},
		{"an ext3 filesystem", []tool{{"mkfs.ext3", "e2fsprogs"}}, func(t *testing.T, img string) { run(t, "mkfs.ext3", "-q", "-F", img) }},
		{"an ext4 filesystem", []tool{{"mkfs.ext4", "e2fsprogs"}}, func(t *testing.T, img string) { run(t, "mkfs.ext4", "-q", "-F", img) }},
		{"an XFS filesystem", []tool{{"mkfs.xfs", "xfsprogs"}}, func(t *testing.T, img string) { run(t, "mkfs.xfs", "-q", "-f", "-d", "name="+img) }},
		{"a btrfs filesystem", []tool{{"mkfs.btrfs", "btrfs-progs"}}, func(t *testing.T, img string) { run(t, "mkfs.btrfs", "-q", "-f", img) }},
		{"a FAT filesystem", []tool{{"mkfs.vfat", "dosfstools"}}, func(t *testing.T, img string) { run(t, "mkfs.vfat", img) }},
		{"Linux swap space", []tool{{"mkswap", "util-linux"}}, func(t *testing.T, img string) { run(t, "mkswap", img) }},
		{"a GPT partition table", []tool{{"sgdisk", "gdisk"}}, func(t *testing.T, img string) { run(t, "sgdisk", "-o", "-n", "1:0:0", img) }},
		{"an MBR partition table or boot sector", []tool{{"sfdisk", "fdisk"}}, func(t *testing.T, img string) {
			cmd := exec.Command("sfdisk", "-q", img)
			cmd.Stdin = strings.NewReader("label: dos\n,,83\n")
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("sfdisk: %v\n%s", err, out)
			}
		}},
		{"a LUKS1 header", []tool{{"cryptsetup", "cryptsetup-bin"}}, func(t *testing.T, img string) { luks(t, img, "luks1") }},
		{"a LUKS2 header", []tool{{"cryptsetup", "cryptsetup-bin"}}, func(t *testing.T, img string) { luks(t, img, "luks2") }},
	} {
		t.Run(tc.want, func(t *testing.T) {
			t.Parallel()
			for _, n := range tc.need {
				testtool.Need(t, n.prog, n.pkg)
			}
			img := filepath.Join(t.TempDir(), "img")
			if err := os.WriteFile(img, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(img, 320<<20); err != nil { // sparse; mkfs.xfs wants 300 MB
				t.Fatal(err)
			}
			tc.make(t, img)
			if got := detect(t, img); got != tc.want {
				t.Fatalf("Detect = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestDetectPlaced: the signatures no tool here makes, placed where their formats put
// them; and nothing at all in zeroes or random-looking bytes.
func TestDetectPlaced(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		want   string
		off    int64 // negative: from the end
		sig    string
		second struct {
			off int64
			sig string
		}
	}{
		{want: "FreeBSD geli metadata (in the last sector)", off: -512, sig: "GEOM::ELI"},
		{want: "FreeBSD geli metadata (in the last sector)", off: -4096, sig: "GEOM::ELI"},
		{want: "an NTFS filesystem", off: 3, sig: "NTFS    "},
		{want: "an ISO 9660 filesystem", off: 32769, sig: "CD001"},
		{want: "a LUKS2 header (its secondary copy)", off: 64 << 10, sig: "SKUL\xba\xbe"},
		{want: "Linux swap space", off: 65536 - 10, sig: "SWAPSPACE2"},
		{want: "an LVM2 physical volume", off: 512, sig: "LABELONE", second: struct {
			off int64
			sig string
		}{536, "LVM2 001"}},
		{want: "", off: 100, sig: "\x37\x91\xfe\x02\x11"},
	} {
		img := filepath.Join(t.TempDir(), "img")
		b := make([]byte, 1<<20)
		put := func(off int64, sig string) {
			if off < 0 {
				off += int64(len(b))
			}
			copy(b[off:], sig)
		}
		put(tc.off, tc.sig)
		if tc.second.sig != "" {
			put(tc.second.off, tc.second.sig)
		}
		if err := os.WriteFile(img, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if got := detect(t, img); got != tc.want {
			t.Errorf("%q at %d: Detect = %q, want %q", tc.sig, tc.off, got, tc.want)
		}
	}
	// A provider smaller than the places looked at.
	img := filepath.Join(t.TempDir(), "tiny")
	if err := os.WriteFile(img, []byte("XFSB"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := detect(t, img); got != "an XFS filesystem" {
		t.Errorf("4-byte XFS magic: %q", got)
	}
}

func detect(t *testing.T, img string) string {
	t.Helper()
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	got, err := Detect(f, st.Size())
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func run(t *testing.T, prog string, args ...string) {
	t.Helper()
	if out, err := exec.Command(prog, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", prog, err, out)
	}
}

func luks(t *testing.T, img, typ string) {
	t.Helper()
	key := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(key, []byte("signature test key"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The cheapest KDF the format allows: only the header's magic matters here.
	args := []string{"luksFormat", "-q", "--type", typ, "--key-file", key, "--pbkdf-force-iterations", "1000", "--pbkdf", "pbkdf2", img}
	run(t, "cryptsetup", args...)
}

package vm

import (
	"bytes"
	"compress/gzip"
	"io"
	"reflect"
	"strconv"
	"testing"
)

func TestParseModInfo(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in      string
		depends, soft []string
	}{
		{"ext4", "license=GPL\x00softdep=pre: crc32c\x00depends=jbd2,mbcache,crc16\x00intree=Y\x00name=ext4\x00",
			[]string{"jbd2", "mbcache", "crc16"}, []string{"crc32c"}},
		{"none", "depends=\x00name=nbd\x00", nil, nil},
		{"dashes and post", "depends=crc-t10dif\x00softdep=pre: a b-c post: d\x00", []string{"crc_t10dif"}, []string{"a", "b_c"}},
		{"garbage", "\x00\x00no-equals\x00", nil, nil},
	} {
		mi := parseModInfo([]byte(tc.in))
		if !reflect.DeepEqual(mi.Depends, tc.depends) || !reflect.DeepEqual(mi.SoftPre, tc.soft) {
			t.Errorf("%s: got %+v, want depends %v soft %v", tc.name, mi, tc.depends, tc.soft)
		}
	}
}

type cpioEntry struct {
	mode uint32
	body string
}

// readNewc parses a newc archive, checking the magic and the 4-byte alignment of every
// header and body, as the kernel's unpacker requires.
func readNewc(t *testing.T, b []byte) ([]string, map[string]cpioEntry) {
	t.Helper()
	var names []string
	ents := map[string]cpioEntry{}
	off := 0
	field := func(i int) uint32 {
		v, err := strconv.ParseUint(string(b[off+6+8*i:off+14+8*i]), 16, 32)
		if err != nil {
			t.Fatalf("header at %d: %v", off, err)
		}
		return uint32(v)
	}
	for {
		if off%4 != 0 {
			t.Fatalf("header at unaligned offset %d", off)
		}
		if string(b[off:off+6]) != "070701" {
			t.Fatalf("bad magic at %d: %q", off, b[off:off+6])
		}
		mode, size, nameLen := field(1), field(6), field(11)
		name := string(b[off+110 : off+110+int(nameLen)-1])
		if b[off+110+int(nameLen)-1] != 0 {
			t.Fatalf("%s: name not NUL-terminated", name)
		}
		off += 110 + int(nameLen)
		off = (off + 3) &^ 3
		body := string(b[off : off+int(size)])
		off += int(size)
		off = (off + 3) &^ 3
		if name == "TRAILER!!!" {
			if off != len(b) {
				t.Errorf("%d bytes after the trailer", len(b)-off)
			}
			return names, ents
		}
		names = append(names, name)
		ents[name] = cpioEntry{mode, body}
	}
}

func TestInitramfs(t *testing.T) {
	t.Parallel()
	var rd Initramfs
	rd.File("init", []byte("#!/bin/sh\n"), 0o755)
	rd.File("/lib/eli-modules/nbd.ko", []byte("12345"), 0o644)
	rd.Symlink("bin/sh", "busybox")
	rd.Dir("proc")
	var buf bytes.Buffer
	if _, err := rd.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(&buf)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	names, ents := readNewc(t, raw)
	want := []string{"bin", "bin/sh", "init", "lib", "lib/eli-modules", "lib/eli-modules/nbd.ko", "proc"}
	if !reflect.DeepEqual(names, want) {
		t.Fatalf("names %q, want %q (parents first)", names, want)
	}
	for name, w := range map[string]cpioEntry{
		"init":                   {0o100755, "#!/bin/sh\n"},
		"lib/eli-modules/nbd.ko": {0o100644, "12345"},
		"bin/sh":                 {0o120777, "busybox"},
		"lib":                    {0o040755, ""},
		"proc":                   {0o040755, ""},
	} {
		if got := ents[name]; got != w {
			t.Errorf("%s: mode %o body %q, want mode %o body %q", name, got.mode, got.body, w.mode, w.body)
		}
	}
}

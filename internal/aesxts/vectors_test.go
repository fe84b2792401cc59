package aesxts

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"testing"
)

type vector struct {
	name          string
	key           []byte
	index         uint64
	plain, cipher []byte
}

// readVectors parses testdata/ieee1619.txt (its header says where the vectors come from).
func readVectors(t *testing.T) []vector {
	t.Helper()
	f, err := os.Open("testdata/ieee1619.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var vs []vector
	s := bufio.NewScanner(f)
	s.Buffer(nil, 1<<16)
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		fs := strings.Fields(line)
		if len(fs) != 5 {
			t.Fatalf("vector line with %d fields: %.40q", len(fs), line)
		}
		v := vector{name: fs[0]}
		if v.index, err = strconv.ParseUint(fs[2], 16, 64); err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		for i, dst := range []*[]byte{&v.key, &v.plain, &v.cipher} {
			if *dst, err = hex.DecodeString(fs[[]int{1, 3, 4}[i]]); err != nil {
				t.Fatalf("%s: %v", v.name, err)
			}
		}
		vs = append(vs, v)
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	if len(vs) < 6 {
		t.Fatalf("read %d vectors, want at least 6", len(vs))
	}
	return vs
}

// TestIEEE1619Vectors runs the IEEE 1619 Annex B vectors on every engine, through
// Encrypt and Decrypt and, as a run of one unit, EncryptSectors and DecryptSectors.
func TestIEEE1619Vectors(t *testing.T) {
	t.Parallel()
	vs := readVectors(t)
	for _, e := range engines() {
		for _, v := range vs {
			c := mustCipher(t, v.key, e)
			n := len(v.plain)
			got := make([]byte, n)
			c.Encrypt(got, v.plain, v.index)
			if !bytes.Equal(got, v.cipher) {
				t.Errorf("%v %s: Encrypt differs at byte %d", e, v.name, firstDiff(got, v.cipher))
			}
			c.Decrypt(got, v.cipher, v.index)
			if !bytes.Equal(got, v.plain) {
				t.Errorf("%v %s: Decrypt differs at byte %d", e, v.name, firstDiff(got, v.plain))
			}
			buf := bytes.Clone(v.plain)
			c.EncryptSectors(buf, buf, n, v.index)
			if !bytes.Equal(buf, v.cipher) {
				t.Errorf("%v %s: EncryptSectors differs at byte %d", e, v.name, firstDiff(buf, v.cipher))
			}
			c.DecryptSectors(buf, buf, n, v.index)
			if !bytes.Equal(buf, v.plain) {
				t.Errorf("%v %s: DecryptSectors differs at byte %d", e, v.name, firstDiff(buf, v.plain))
			}
		}
	}
}

// TestIEEE1619Run encrypts vectors 4 and 5 (units 0 and 1 under one key) as one run of
// two units on every engine: the second unit's tweak is the one a kernel computes ahead.
func TestIEEE1619Run(t *testing.T) {
	t.Parallel()
	var v4, v5 vector
	for _, v := range readVectors(t) {
		switch v.name {
		case "vector-4":
			v4 = v
		case "vector-5":
			v5 = v
		}
	}
	if v4.key == nil || v5.key == nil || !bytes.Equal(v4.key, v5.key) || v5.index != v4.index+1 {
		t.Fatal("testdata lacks vectors 4 and 5 as consecutive units under one key")
	}
	plain := append(bytes.Clone(v4.plain), v5.plain...)
	want := append(bytes.Clone(v4.cipher), v5.cipher...)
	for _, e := range engines() {
		c := mustCipher(t, v4.key, e)
		got := make([]byte, len(plain))
		c.EncryptSectors(got, plain, len(v4.plain), v4.index)
		if !bytes.Equal(got, want) {
			t.Errorf("%v: EncryptSectors of vectors 4 and 5 differs at byte %d", e, firstDiff(got, want))
		}
		c.DecryptSectors(got, got, len(v4.plain), v4.index)
		if !bytes.Equal(got, plain) {
			t.Errorf("%v: DecryptSectors of vectors 4 and 5 differs at byte %d", e, firstDiff(got, plain))
		}
	}
}

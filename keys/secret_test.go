package keys

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/elidisk/eli/sector"
	"golang.org/x/sys/unix"
)

func TestSecretsNeverPrint(t *testing.T) {
	t.Parallel()
	s := NewSecret(16)
	defer s.Wipe()
	copy(s.Bytes(), "SUPERSECRETKEYXX")
	mk, err := NewMasterKey([16]byte{1}, bytes.Repeat([]byte("K"), MasterKeySize))
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	c := Credentials{Passphrase: []byte("SUPERSECRETPASS"), Keyfiles: [][]byte{[]byte("SUPERSECRETFILE")}}
	holder := struct {
		S *Secret
		K *MasterKey
		C Credentials
	}{s, mk, c}

	var out bytes.Buffer
	for _, v := range []any{s, *s, mk, *mk, c, &c, holder, &holder} {
		for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%X", "%d"} {
			fmt.Fprintf(&out, verb+"\n", v)
		}
		fmt.Fprintln(&out, v)
		j, _ := json.Marshal(v)
		out.Write(j)
	}
	slog.New(slog.NewTextHandler(&out, nil)).Info("keys", "s", s, "mk", mk, "c", c, "h", holder)
	slog.New(slog.NewJSONHandler(&out, nil)).Info("keys", "s", s, "mk", mk, "c", c, "h", holder)
	text := out.String()
	for _, secret := range []string{"SUPERSECRET", "KKKK", "4b4b4b4b", "4B4B4B4B", "75 75 75", "[75 75"} {
		if strings.Contains(text, secret) {
			t.Errorf("formatted output contains %q:\n%s", secret, text)
		}
	}
	if !strings.Contains(text, redacted) {
		t.Error("formatted output never says [redacted]")
	}
}

func TestSecretLifecycle(t *testing.T) {
	t.Parallel()
	for _, n := range []int{0, 1, 32, 4096, 5000} {
		s := NewSecret(n)
		if s.Len() != n || len(s.Bytes()) != n || !allZero(s.Bytes()) {
			t.Errorf("NewSecret(%d): len %d, zero %v", n, s.Len(), allZero(s.Bytes()))
		}
		for i := range s.Bytes() {
			s.Bytes()[i] = 0xa5
		}
		if n > 0 && !s.Locked() && MemoryLockError() == nil {
			t.Errorf("NewSecret(%d) not locked, and no lock error recorded", n)
		}
		cp := *s // a copy is a handle to the same buffer
		s.Wipe()
		s.Wipe()
		if s.Len() != 0 || s.Bytes() != nil || cp.Len() != 0 || s.Locked() {
			t.Errorf("after Wipe: len %d, copy len %d, locked %v", s.Len(), cp.Len(), s.Locked())
		}
	}
	var nilSecret *Secret
	nilSecret.Wipe()
	if nilSecret.Bytes() != nil || nilSecret.Len() != 0 {
		t.Error("nil Secret is not empty")
	}
}

// Key operations wipe every intermediate secret (ikm, KEKs, derived keys, failed unwraps).
// Not parallel: it counts the package's live mappings while no other test runs.
func TestNoSecretLeftBehind(t *testing.T) {
	p, mk := newVolume(t)
	kf := Credentials{Passphrase: []byte("p"), Keyfiles: [][]byte{[]byte("k")}}
	before := liveMappings.Load()
	if _, err := SetKey(p, mk, AnySlot, kf, tiny); err != nil {
		t.Fatal(err)
	}
	h := mustRead(t, p)
	for _, c := range []Credentials{pass("pw0"), pass("wrong"), kf, {Keyfiles: [][]byte{[]byte("k")}}} {
		if k, _, err := h.Unlock(c, AnySlot); err == nil {
			k.Wipe()
		}
	}
	if err := Resize(p, mk, 501); err != nil {
		t.Fatal(err)
	}
	for _, k := range []*Secret{mk.DataKey(sector.ModeAESXTS256), mk.JournalKey()} {
		k.Wipe()
	}
	if after := liveMappings.Load(); after != before {
		t.Errorf("%d secrets left mapped after setkey, unlocks, resize and derivations", after-before)
	}
}

// Wipe zeroes the memory before it releases it.
func TestRegionZeroes(t *testing.T) {
	t.Parallel()
	s := NewSecret(64)
	copy(s.Bytes(), bytes.Repeat([]byte{0xff}, 64))
	r := s.s.region
	r.zero()
	if !allZero(r.mem) {
		t.Error("zero left key bytes in the mapping")
	}
	s.Wipe()
}

func TestMasterKeyDerivations(t *testing.T) {
	t.Parallel()
	id := [16]byte{9}
	raw := bytes.Repeat([]byte{7}, MasterKeySize)
	mk, err := NewMasterKey(id, raw)
	if err != nil {
		t.Fatal(err)
	}
	defer mk.Wipe()
	raw[0] = 8 // NewMasterKey copied it
	if mk.Bytes()[0] != 7 || mk.VolumeID() != id || !mk.key.Locked() && MemoryLockError() == nil {
		t.Error("NewMasterKey did not copy the key into a Secret of its own")
	}
	if _, err := NewMasterKey(id, raw[:32]); err == nil {
		t.Error("NewMasterKey took a 32-byte key")
	}
	seen := map[string]string{}
	for _, m := range sector.Modes() {
		k := mk.DataKey(m)
		if k.Len() != m.KeySize() {
			t.Errorf("DataKey(%v) is %d bytes, want %d", m, k.Len(), m.KeySize())
		}
		k.Wipe()
	}
	for name, k := range map[string]*Secret{
		"data":    mk.DataKey(sector.ModeXChaCha20Poly1305),
		"journal": mk.JournalKey(),
		"mac":     mk.headerMACKey(),
	} {
		if other, dup := seen[string(k.Bytes())]; dup {
			t.Errorf("%s key equals %s key", name, other)
		}
		seen[string(k.Bytes())] = name
		k.Wipe()
	}
	// Another volume ID (the HKDF salt) gives other keys from the same master key.
	mk2, _ := NewMasterKey([16]byte{10}, bytes.Repeat([]byte{7}, MasterKeySize))
	defer mk2.Wipe()
	a, b := mk.JournalKey(), mk2.JournalKey()
	if bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("journal key does not depend on the volume ID")
	}
	a.Wipe()
	b.Wipe()

	g, err := GenerateMasterKey()
	if err != nil {
		t.Fatal(err)
	}
	defer g.Wipe()
	if allZero(g.Bytes()) || g.VolumeID() == [16]byte{} {
		t.Error("GenerateMasterKey returned zeroes")
	}
	mk2.Wipe()
	if mk2.Bytes() != nil {
		t.Error("Wipe left the key")
	}
}

// ForbidCoreDumps runs in a child process, since it changes the process for good.
func TestForbidCoreDumps(t *testing.T) {
	if os.Getenv("ELI_KEYS_COREDUMP_CHILD") == "1" {
		if err := ForbidCoreDumps(); err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		dumpable, err := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0)
		var lim unix.Rlimit
		if err2 := unix.Getrlimit(unix.RLIMIT_CORE, &lim); err != nil || err2 != nil {
			fmt.Println("error:", err, err2)
			os.Exit(1)
		}
		fmt.Printf("dumpable=%d core=%d/%d\n", dumpable, lim.Cur, lim.Max)
		os.Exit(0)
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^TestForbidCoreDumps$")
	cmd.Env = append(os.Environ(), "ELI_KEYS_COREDUMP_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v: %s", err, out)
	}
	if !strings.Contains(string(out), "dumpable=0 core=0/0") {
		t.Errorf("child reports %q, want dumpable=0 core=0/0", out)
	}
}

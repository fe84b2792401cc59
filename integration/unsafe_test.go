package integration

import (
	"bytes"
	"fmt"
	"os"
	"testing"

	"github.com/elidisk/eli/sector"
)

// Scenario 5 (issue 6): the flaw of the *-xts ChaCha modes, shown end to end. An attacker
// who can write known plaintext to a sector through the export (or knows what a sector
// held) and read the provider twice recovers what is written there next: the keystream
// depends only on the key and the sector number, so C1 ⊕ C2 ⊕ P1 = P2. The same steps on
// the default mode (fresh nonce per write) and on AES-XTS (a block cipher, no keystream)
// recover nothing.
func TestUnsafeModeFlaw(t *testing.T) {
	t.Parallel()
	type tc struct {
		mode      sector.Mode
		recovered bool
	}
	var cases []tc
	for _, m := range sector.Modes() {
		switch {
		case m.Unsafe():
			cases = append(cases, tc{m, true})
		case m == sector.Default || m == sector.ModeAESXTS256:
			cases = append(cases, tc{m, false})
		}
	}
	for _, c := range cases {
		t.Run(c.mode.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, false)
			img := e.create(volume{name: "u.img", size: "16M", mode: c.mode.String()})
			l := e.dumpLayout(img)
			uri := e.Attach(img)
			// Sector 150 lies in the second group of the authenticated layout (102 records
			// per group at 4096), so the group arithmetic is exercised too.
			const i = 150
			at := l.dataAt(t, i)

			known := bytes.Repeat([]byte("known plaintext!"), int(l.S)/16)
			secret := make([]byte, l.S)
			for k := range secret {
				secret[k] = "attack at dawn; the key is under the mat. "[k%42] ^ byte(k/42)
			}

			pythonNBD(t, known, "pwrite", uri, fmt.Sprint(i*l.S))
			c1 := readProvider(t, img, at, l.S)
			pythonNBD(t, secret, "pwrite", uri, fmt.Sprint(i*l.S))
			c2 := readProvider(t, img, at, l.S)

			// The attacker read the right bytes: they changed with each write, they are not
			// the plaintext, and the never-written sector after them is untouched.
			if bytes.Equal(c1, c2) || bytes.Equal(c1, known) || bytes.Equal(c2, secret) {
				t.Fatalf("provider at %d: the ciphertexts are equal or hold the plaintext", at)
			}
			if next := readProvider(t, img, l.dataAt(t, i+1), l.S); !bytes.Equal(next, make([]byte, l.S)) {
				t.Fatalf("sector %d's stored bytes changed, but only sector %d was written", i+1, i)
			}

			e.detach("u.img")

			recovered := make([]byte, l.S)
			same := 0
			for k := range recovered {
				recovered[k] = c1[k] ^ c2[k] ^ known[k]
				if recovered[k] == secret[k] {
					same++
				}
			}
			if c.recovered {
				if !bytes.Equal(recovered, secret) {
					t.Fatalf("%s: C1⊕C2⊕P1 is not the secret (%d of %d bytes match)", c.mode, same, l.S)
				}
				t.Logf("%s: secret recovered from two ciphertexts: %q...", c.mode, recovered[:42])
				return
			}
			// By chance about 1 byte in 256 matches; a leak would match far more.
			if same > int(l.S)/32 {
				t.Fatalf("%s: %d of %d bytes of the secret recovered", c.mode, same, l.S)
			}
		})
	}
}

// readProvider reads n bytes of the provider file at off, as an attacker with the disk
// would (the server has flushed, so the bytes are in the file).
func readProvider(t testing.TB, path string, off, n int64) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatalf("read provider %s at %d: %v", path, off, err)
	}
	return b
}

package remote

import (
	"bytes"
	"net"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// nbdkitMemory serves an nbdkit memory export of size on a unix socket and returns
// its URI.
func nbdkitMemory(t *testing.T, size string, filters, params []string) string {
	t.Helper()
	bin := testtool.Need(t, "nbdkit", "nbdkit")
	sock := filepath.Join(t.TempDir(), "s")
	cmd := exec.Command(bin, append(append(append([]string{"-f", "--exit-with-parent", "-U", sock}, filters...), "memory", size), params...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("nbdkit did not start")
		}
	}
	return "nbd+unix:///?socket=" + sock
}

// Open over a real export: the capabilities come from what the server said, and the
// ownership block stays hidden from reads and writes through the Store.
func TestOpenCapabilities(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		filters []string
		params  []string
		punch   bool
		atomic  int
	}{
		{"memory", nil, nil, true, 4096},
		{"no zero, 64K blocks", []string{"--filter=nozero", "--filter=blocksize-policy"},
			[]string{"blocksize-minimum=512", "blocksize-preferred=65536", "blocksize-maximum=1M"}, false, 65536},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			uri := nbdkitMemory(t, "16M", tc.filters, tc.params)
			s, err := Open(uri, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			c := s.Capabilities()
			if !c.Shared || c.SerialWrites || (c.Punch != nil) != tc.punch || c.AtomicWrite != tc.atomic {
				t.Fatalf("capabilities %+v: want shared, parallel writes, punch %v, atomic unit %d", c, tc.punch, tc.atomic)
			}
			if err := s.Claim(ClaimOptions{}); err != nil {
				t.Fatal(err)
			}
			data := bytes.Repeat([]byte{0xEE}, 16384)
			if _, err := s.WriteAt(data, 0); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(data))
			if _, err := s.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			want := bytes.Clone(data)
			clear(want[MarkOffset : MarkOffset+MarkLen])
			if !bytes.Equal(got, want) {
				t.Fatal("the ownership block shows through the Store, or data around it is wrong")
			}
			if m, err := s.readMark(); err != nil || m.State != Held {
				t.Fatalf("mark after a write over it: %+v %v", m, err)
			}
			if c.Punch != nil { // the Store's own, which skips the ownership block too
				if err := c.Punch(0, 65536); err != nil {
					t.Fatal(err)
				}
				if m, err := s.readMark(); err != nil || m.State != Held {
					t.Fatalf("mark after a punch over it: %+v %v", m, err)
				}
			}
		})
	}
}

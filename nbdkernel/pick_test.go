package nbdkernel

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestPick(t *testing.T) {
	t.Parallel()
	const be = "eli:0102"
	live := strconv.Itoa(os.Getpid())
	dead := strconv.Itoa(deadPid(t))
	for _, tc := range []struct {
		name  string
		files map[string]string
		want  int
	}{
		{"the lowest free device", map[string]string{"sys/block/nbd10/dev": "43:0", "sys/block/nbd2/dev": "43:0", "sys/block/nbd3/dev": "43:0", "sys/block/loop0/dev": "43:0"}, 2},
		{"connected devices are skipped", map[string]string{"sys/block/nbd0/pid": live, "sys/block/nbd1/pid": dead, "sys/block/nbd1/backend": "eli:other", "sys/block/nbd2/dev": "43:0"}, 2},
		{"the device that waits for this volume first", map[string]string{"sys/block/nbd0/dev": "43:0", "sys/block/nbd5/pid": dead, "sys/block/nbd5/backend": be}, 5},
		{"not one whose server lives", map[string]string{"sys/block/nbd0/dev": "43:0", "sys/block/nbd5/pid": live, "sys/block/nbd5/backend": be}, 0},
	} {
		h := fakeHost(t, tc.files)
		got, release, err := h.pick(be, t.TempDir())
		if err != nil || got != tc.want {
			t.Errorf("%s: picked %d, %v; want nbd%d", tc.name, got, err, tc.want)
			continue
		}
		release()
	}

	none := fakeHost(t, map[string]string{"sys/block/loop0/dev": "43:0"})
	if _, _, err := none.pick(be, t.TempDir()); !errors.Is(err, ErrNoFreeDevice) || !contains(err, "modprobe nbd") {
		t.Errorf("without the module: %v", err)
	}
	full := fakeHost(t, map[string]string{"sys/block/nbd0/pid": live})
	if _, _, err := full.pick(be, t.TempDir()); !errors.Is(err, ErrNoFreeDevice) || !contains(err, "all 1 are connected") {
		t.Errorf("all taken: %v", err)
	}
}

// TestPickClaims: two attaches that pick at once get two devices; a released claim
// frees its device for the next.
func TestPickClaims(t *testing.T) {
	t.Parallel()
	h := fakeHost(t, map[string]string{"sys/block/nbd0/dev": "43:0", "sys/block/nbd1/dev": "43:0"})
	claims := filepath.Join(t.TempDir(), "claims")
	a, releaseA, err := h.pick("eli:a", claims)
	if err != nil {
		t.Fatal(err)
	}
	b, releaseB, err := h.pick("eli:b", claims)
	if err != nil || a == b {
		t.Fatalf("second pick: nbd%d, %v; the first has nbd%d", b, err, a)
	}
	if _, _, err := h.pick("eli:c", claims); !errors.Is(err, ErrNoFreeDevice) {
		t.Errorf("third pick with both claimed: %v", err)
	}
	releaseA()
	c, releaseC, err := h.pick("eli:c", claims)
	if err != nil || c != a {
		t.Errorf("after a release: nbd%d, %v; want nbd%d", c, err, a)
	}
	releaseB()
	releaseC()
}

func contains(err error, s string) bool { return err != nil && strings.Contains(err.Error(), s) }

package nbdclient

import (
	"bytes"
	"errors"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/testtool"
)

// startNbdkit serves an in-memory export with nbdkit, the reference server, so the
// client is checked against someone else's reading of the protocol.
func startNbdkit(t *testing.T, args ...string) string {
	t.Helper()
	prog := testtool.Need(t, "nbdkit", "nbdkit")
	sock := filepath.Join(t.TempDir(), "s")
	cmd := exec.Command(prog, append([]string{"--foreground", "--exit-with-parent", "-U", sock}, args...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for i := 0; i < 200; i++ {
		if c, err := Dial("unix", sock, ""); err == nil {
			c.Close()
			return sock
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("nbdkit did not start")
	return ""
}

func TestAgainstNbdkit(t *testing.T) {
	t.Parallel()
	sock := startNbdkit(t, "memory", "1M")
	c, err := Dial("unix", sock, "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Export.Size != 1<<20 {
		t.Fatalf("size %d", c.Export.Size)
	}
	if c.Export.Flags&FlagSendFlush == 0 || c.Export.Flags&FlagSendTrim == 0 {
		t.Errorf("flags %#x lack flush/trim", c.Export.Flags)
	}
	data := bytes.Repeat([]byte("eli!"), 2048)
	if err := c.WriteAt(data, 4096, true); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if err := c.ReadAt(got, 4096); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("read back differs")
	}
	if err := c.WriteZeroes(4096, 4096); err != nil {
		t.Fatal(err)
	}
	if err := c.ReadAt(got[:4096], 4096); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:4096], make([]byte, 4096)) {
		t.Fatal("write-zeroes did not zero")
	}
	if err := c.Trim(8192, 4096); err != nil {
		t.Fatal(err)
	}
	// Past the end: an error reply, and the connection still works.
	err = c.ReadAt(got[:512], 1<<20)
	var ne *Error
	if !errors.As(err, &ne) || !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("read past end: %v, want EINVAL reply", err)
	}
	if err := c.ReadAt(got[:512], 0); err != nil {
		t.Fatalf("connection unusable after error reply: %v", err)
	}
}

func TestOversizedExportName(t *testing.T) {
	t.Parallel()
	sock := startNbdkit(t, "memory", "1M")
	if _, err := Dial("unix", sock, string(make([]byte, 5000))); err == nil {
		t.Fatal("oversized export name accepted")
	}
}

func TestRefusesOversizedRequest(t *testing.T) {
	t.Parallel()
	c := &Client{}
	if err := c.ReadAt(make([]byte, MaxRequest+1), 0); err == nil {
		t.Fatal("request over MaxRequest accepted")
	}
}

package acceptretry

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"
)

func TestTransient(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("accept4: %w", syscall.EMFILE), true},
		{&os.SyscallError{Syscall: "accept4", Err: syscall.ENFILE}, true},
		{syscall.ENOBUFS, true},
		{syscall.ENOMEM, true},
		{syscall.ECONNABORTED, true},
		{os.ErrDeadlineExceeded, true},
		{syscall.EBADF, false},
		{syscall.EINVAL, false},
		{errors.New("use of closed network connection"), false},
	} {
		if got := Transient(tc.err); got != tc.want {
			t.Errorf("Transient(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

func TestBackoff(t *testing.T) {
	var b Backoff
	want := []time.Duration{5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000}
	for i, w := range want {
		if got := b.Next(); got != w*time.Millisecond {
			t.Fatalf("wait %d: %v, want %v", i, got, w*time.Millisecond)
		}
	}
	b.Reset()
	if got := b.Next(); got != minWait {
		t.Fatalf("after Reset: %v, want %v", got, minWait)
	}
}

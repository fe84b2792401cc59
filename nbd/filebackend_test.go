package nbd

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// fileBackend serves a plain file: the backend of the benchmark against nbdkit's file
// plugin, and of the tests run through a separate server process.
type fileBackend struct {
	f    *os.File
	size int64
}

func openFileBackend(path string) (*fileBackend, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &fileBackend{f: f, size: fi.Size()}, nil
}

func (b *fileBackend) Size() int64 { return b.size }

func (b *fileBackend) ReadAt(p []byte, off int64) error {
	n, err := b.f.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if errors.Is(err, io.EOF) {
		return fmt.Errorf("short read at %d: %w", off, unix.EIO)
	}
	return err
}

func (b *fileBackend) WriteAt(p []byte, off int64, f Flags) error {
	if _, err := b.f.WriteAt(p, off); err != nil {
		return err
	}
	if f&FUA != 0 {
		return unix.Fdatasync(int(b.f.Fd()))
	}
	return nil
}

func (b *fileBackend) WriteZeroes(off, n int64, f Flags) error {
	mode := uint32(unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE)
	if f&NoHole != 0 {
		mode = unix.FALLOC_FL_ZERO_RANGE | unix.FALLOC_FL_KEEP_SIZE
	}
	if err := unix.Fallocate(int(b.f.Fd()), mode, off, n); err != nil {
		if errors.Is(err, unix.EOPNOTSUPP) {
			return fmt.Errorf("fallocate: %w", unix.ENOTSUP)
		}
		return err
	}
	if f&FUA != 0 {
		return unix.Fdatasync(int(b.f.Fd()))
	}
	return nil
}

func (b *fileBackend) Trim(off, n int64, f Flags) error {
	return b.WriteZeroes(off, n, f&FUA)
}

func (b *fileBackend) Flush() error { return unix.Fdatasync(int(b.f.Fd())) }

package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/elidisk/eli/internal/daemon"
	"github.com/elidisk/eli/keys"
	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/sector"
	"github.com/elidisk/eli/volume"
	"github.com/spf13/cobra"
)

func newDemoCmd(g *globalOptions) *cobra.Command {
	var dir, size, cipher string
	var keep bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Show eli's main job end to end on a temporary file",
		Long: `Demo runs eli's main job on a file-backed provider in a temporary directory, with
nothing but this binary: init, attach (served over NBD on a unix socket), write and
read back through an NBD client, detach, attach again and check the data, show that
the provider holds only ciphertext, and show that one flipped byte on the provider
makes that sector an I/O error while its neighbours read fine.`,
		Example: "  go run ./cmd/eli demo\n  eli demo --size 256M --keep",
		Args:    exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			sz, err := parseSize(size)
			if err != nil {
				return usageError{err}
			}
			return runDemo(cmd.OutOrStdout(), dir, sz, cipher, keep)
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory for the provider (default: a new temporary one)")
	cmd.Flags().StringVar(&size, "size", "64M", "provider size")
	cmd.Flags().StringVarP(&cipher, "cipher", "e", "xchacha20-poly1305", "cipher mode")
	cmd.Flags().BoolVar(&keep, "keep", false, "keep the provider and passphrase file afterwards")
	return cmd
}

func runDemo(out io.Writer, dir string, size int64, cipher string, keep bool) error {
	step := func(format string, a ...any) { fmt.Fprintf(out, "==> "+format+"\n", a...) }
	if dir == "" {
		d, err := os.MkdirTemp("", "eli-demo-")
		if err != nil {
			return err
		}
		dir = d
		if !keep {
			defer os.RemoveAll(d)
		}
	}
	img := filepath.Join(dir, "demo.img")
	pass := filepath.Join(dir, "passphrase")
	secret := make([]byte, 16)
	rand.Read(secret)
	if err := os.WriteFile(pass, []byte(hex.EncodeToString(secret)+"\n"), 0o600); err != nil {
		return err
	}
	sd := daemon.StateDir{Path: filepath.Join(dir, "state")}

	// init, with a small KDF so that the demo is quick (real volumes calibrate ~1 s).
	step("eli init --size %s --cipher %s %s", formatSize(size), cipher, img)
	iopts := &initOptions{cipher: cipher, sectorSize: 4096, size: fmt.Sprint(size), unsafe: true,
		creds: credFlags{passphraseFile: pass}, kdf: kdfFlags{time: 1, memoryMiB: 32, threads: 1}}
	initCmd := newInitCmd(&globalOptions{})
	initCmd.SetOut(out)
	if err := runInit(initCmd, iopts, img); err != nil {
		return err
	}

	// session attaches the volume as 'eli attach' does, runs f with an NBD client, and
	// detaches; the name and the provider are free again when it returns.
	session := func(f func(c *nbdclient.Client) error) error {
		o := &attachOptions{slot: keys.AnySlot, connections: 1, cacheMiB: 16, creds: credFlags{passphraseFile: pass},
			witness: filepath.Join(dir, "witness")} // the demo leaves nothing outside its directory
		a, err := prepareAttach(sd, o, img)
		if err != nil {
			return err
		}
		defer a.release()
		srv, err := volume.Start(&a.cfg.Config, a.h.Provider(), a.mk, slog.New(slog.DiscardHandler))
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "    serving %s\n", volume.UnixURI(a.cfg.Socket))
		c, err := nbdclient.Dial("unix", a.cfg.Socket, "")
		if err == nil {
			err = f(c)
			c.Close()
		}
		if serr := srv.Shutdown(context.Background()); err == nil {
			err = serr
		}
		return err
	}
	const chunk = 1 << 20
	var data []byte
	var n int64
	readAll := func(c *nbdclient.Client, got []byte) error {
		for off := int64(0); off < n; off += chunk {
			if err := c.ReadAt(got[off:off+chunk], off); err != nil {
				return err
			}
		}
		return nil
	}
	marker := []byte("eli demo: this line is plaintext on the NBD side only")

	step("eli attach %s", img)
	err := session(func(c *nbdclient.Client) error {
		fmt.Fprintf(out, "    NBD export: %s, flags %#x, preferred block %d\n", formatSize(int64(c.Export.Size)), c.Export.Flags, c.Export.PreferredBlock)
		n = min(int64(c.Export.Size), 16<<20) / chunk * chunk
		data = make([]byte, n)
		rand.Read(data)
		copy(data[8192:], marker)

		step("write %s of random data through NBD, flush, read it back", formatSize(n))
		start := time.Now()
		for off := int64(0); off < n; off += chunk {
			if err := c.WriteAt(data[off:off+chunk], off, false); err != nil {
				return err
			}
		}
		if err := c.Flush(); err != nil {
			return err
		}
		wt := time.Since(start)
		got := make([]byte, n)
		start = time.Now()
		if err := readAll(c, got); err != nil {
			return err
		}
		rt := time.Since(start)
		if !bytes.Equal(got, data) {
			return errors.New("demo: data read back differs from what was written")
		}
		fmt.Fprintf(out, "    identical (write %.0f MB/s, read %.0f MB/s over one simple connection)\n",
			float64(n)/wt.Seconds()/1e6, float64(n)/rt.Seconds()/1e6)
		step("eli detach")
		return nil
	})
	if err != nil {
		return err
	}

	raw, err := os.ReadFile(img)
	if err != nil {
		return err
	}
	switch found := bytes.Contains(raw, marker); {
	case found && cipher == sector.ModeNone.String():
		step("mode none does not encrypt: the marker line is in %s as plaintext", img)
	case found:
		return errors.New("demo: plaintext found on the provider")
	default:
		step("the provider holds no plaintext: the marker line is not in %s", img)
	}

	step("eli attach again; the data is intact")
	err = session(func(c *nbdclient.Client) error {
		got := make([]byte, n)
		if err := readAll(c, got); err != nil {
			return err
		}
		if !bytes.Equal(got, data) {
			return errors.New("demo: data differs after re-attach")
		}
		return nil
	})
	if err != nil {
		return err
	}

	h, err := func() (*keys.Header, error) {
		p, err := openReadOnly(img)
		if err != nil {
			return nil, err
		}
		defer p.Close()
		return p.Header()
	}()
	if err != nil {
		return err
	}
	l := h.Layout
	if !l.Authenticated() {
		step("done (%s has no integrity, so the tampering step is skipped)", h.Mode)
		return nil
	}
	off := l.DataPos(2) + 100
	step("flip one byte of the provider at offset %d (inside sector 2), attach, read", off)
	if err := flipByte(img, off); err != nil {
		return err
	}
	err = session(func(c *nbdclient.Client) error {
		buf := make([]byte, l.SectorSize)
		err2 := c.ReadAt(buf, 2*int64(l.SectorSize))
		err1 := c.ReadAt(buf, 1*int64(l.SectorSize))
		err3 := c.ReadAt(buf, 3*int64(l.SectorSize))
		if !errors.Is(err2, syscall.EIO) || err1 != nil || err3 != nil {
			return fmt.Errorf("demo: tampered sector read %v, neighbours %v, %v", err2, err1, err3)
		}
		fmt.Fprintf(out, "    sector 2: %v\n    sectors 1 and 3: read fine\n", err2)
		return nil
	})
	if err != nil {
		return err
	}
	if keep {
		step("done; the provider and its passphrase file are in %s", dir)
	} else {
		step("done")
	}
	return nil
}

func flipByte(path string, off int64) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		return err
	}
	b[0] ^= 0x01
	_, err = f.WriteAt(b, off)
	return err
}

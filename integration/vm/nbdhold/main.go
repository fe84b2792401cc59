// Command nbdhold is a test tool for the VM test TestVMHoldDevice: it connects a kernel NBD
// device to an export of a running eli (as 'eli attach --device' does: negotiated sockets
// handed over netlink), keeps the kernel's sockets through nbdkernel.Device, and changes
// the device's timeouts on signals, so that the guest can hold the server (SIGSTOP) the way
// a suspended eli will, with the timeouts raised as the suspend will raise them.
//
//	SIGUSR1  raise the timeouts to -hold (Device.SetTimeout, or with -netlink-only
//	         nbdkernel.SetRequestTimeout alone: the sockets keep their send timeout)
//	SIGUSR2  restore them to nbdkernel.DefaultTimeout
//	SIGTERM  disconnect the device and exit
//
// After connecting and after each change it appends a line to -status: "connected", "raised"
// or "restored", then the request timeout the kernel reports (ms) and each socket's send
// timeout (ms), or "error" and the message.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/elidisk/eli/nbdclient"
	"github.com/elidisk/eli/nbdkernel"
)

func main() {
	socket := flag.String("socket", "", "eli's unix socket")
	device := flag.String("device", "", "/dev/nbdN to connect")
	conns := flag.Int("connections", 2, "sockets to hand to the kernel")
	hold := flag.Duration("hold", 24*time.Hour, "timeout while held (SIGUSR1)")
	netlinkOnly := flag.Bool("netlink-only", false, "SIGUSR1 raises the request timeout only, not the sockets' send timeout")
	status := flag.String("status", "", "file to append status lines to")
	flag.Parse()
	if err := run(*socket, *device, *conns, *hold, *netlinkOnly, *status); err != nil {
		fmt.Fprintln(os.Stderr, "nbdhold:", err)
		os.Exit(1)
	}
}

func run(socket, device string, conns int, hold time.Duration, netlinkOnly bool, status string) error {
	idx, err := nbdkernel.ParseDevice(device)
	if err != nil {
		return err
	}
	if conns < 1 || status == "" || socket == "" {
		return fmt.Errorf("need -socket, -status and -connections >= 1")
	}
	out, err := os.OpenFile(status, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()

	// The negotiated sockets, as 'eli attach --device' makes them; the Device keeps
	// duplicates, these are closed once the kernel has them.
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	var flags uint16
	var size uint64
	var block uint32
	for range conns {
		c, err := nbdclient.Dial("unix", socket, "")
		if err != nil {
			return err
		}
		flags, size, block = c.Export.Flags, c.Export.Size, c.Export.PreferredBlock
		f, err := c.Conn().(*net.UnixConn).File()
		c.Conn().Close()
		if err != nil {
			return err
		}
		files = append(files, f)
	}
	backend := fmt.Sprintf("nbdhold:%d", os.Getpid())
	cfg := nbdkernel.Config{Index: idx, Size: size, BlockSize: uint64(block), ServerFlags: flags,
		TimeoutSeconds: uint64(nbdkernel.DefaultTimeout / time.Second), DeadConnTimeoutSeconds: nbdkernel.DeadConnTimeout,
		Backend: backend, Sockets: files}
	if _, err := nbdkernel.Connect(cfg); err != nil {
		return err
	}
	defer nbdkernel.Disconnect(idx)
	dev, err := nbdkernel.NewDevice(idx, backend, files)
	if err != nil {
		return err
	}
	defer dev.Close()
	for _, f := range files {
		f.Close()
	}
	files = nil
	if _, err := nbdkernel.Tune(idx); err != nil {
		return err
	}

	report := func(what string, err error) {
		if err != nil {
			fmt.Fprintf(out, "%s error %v\n", what, err)
			return
		}
		line := what
		if rq, err := nbdkernel.RequestTimeout(idx); err == nil {
			line += fmt.Sprintf(" %d", rq.Milliseconds())
		} else {
			line += " ?"
		}
		snd, err := dev.SendTimeouts()
		for _, s := range snd {
			line += fmt.Sprintf(" %d", s.Milliseconds())
		}
		if err != nil {
			line += " ?"
		}
		fmt.Fprintln(out, line)
	}
	report("connected", nil)

	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGTERM, syscall.SIGINT)
	for s := range sig {
		switch s {
		case syscall.SIGUSR1:
			if netlinkOnly {
				report("raised", nbdkernel.SetRequestTimeout(idx, backend, hold))
			} else {
				report("raised", dev.SetTimeout(hold))
			}
		case syscall.SIGUSR2:
			report("restored", dev.SetTimeout(nbdkernel.DefaultTimeout))
		default:
			return nil
		}
	}
	return nil
}

// Package nbdkernel connects an NBD export to the Linux kernel's NBD driver (/dev/nbdN)
// over generic netlink, the interface nbd-client uses since Linux 4.12: userspace does the
// handshake on each socket, then hands the negotiated sockets to the kernel with
// NBD_CMD_CONNECT. The kernel then speaks the transmission phase itself.
//
// Constants are from include/uapi/linux/nbd-netlink.h and include/uapi/linux/nbd.h.
//
// This path needs the nbd module (modprobe nbd) and CAP_SYS_ADMIN. The message encoding
// and the device checks are unit-tested here; the end-to-end behaviour (geometry, a
// filesystem, detach refused while in use, re-plugging after a crash or a restart) is
// tested in a VM running Debian's 6.1 kernel (integration/vm_test.go).
package nbdkernel

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
)

const (
	familyName = "nbd"

	cmdConnect     = 1
	cmdDisconnect  = 2
	cmdReconfigure = 3

	attrIndex           = 1
	attrSizeBytes       = 2
	attrBlockSizeBytes  = 3
	attrTimeout         = 4
	attrServerFlags     = 5
	attrClientFlags     = 6
	attrSockets         = 7
	attrDeadConnTimeout = 8
	attrBackend         = 10

	sockItem = 1
	sockFD   = 1

	// NBD_CFLAG_DISCONNECT_ON_CLOSE: not used; eli detaches explicitly.
	clientFlagDestroyOnDisconnect = 1 << 0
)

// Config is what the kernel needs to drive an export.
type Config struct {
	// Index is N in /dev/nbdN; -1 lets the kernel pick a free device.
	Index int
	// Size of the export in bytes, and its block size (eli's sector size).
	Size      uint64
	BlockSize uint64
	// ServerFlags are the transmission flags the server sent in the handshake, so the
	// kernel knows it may send FLUSH, FUA, TRIM and WRITE_ZEROES.
	ServerFlags uint16
	// TimeoutSeconds per request; 0 keeps the kernel's default.
	TimeoutSeconds uint64
	// DeadConnTimeoutSeconds is how long the kernel holds I/O when every connection is
	// dead (the server crashed or is being restarted), waiting for Reconfigure to plug
	// in new sockets, before it fails the I/O. 0 fails it at once.
	DeadConnTimeoutSeconds uint64
	// Backend identifies the export (the kernel shows it in /sys/block/nbdN/backend);
	// Attach re-plugs a live device only for the same backend.
	Backend string
	// Sockets are negotiated connections (transmission phase), one per kernel queue.
	Sockets []*os.File
}

var devRE = regexp.MustCompile(`^/dev/nbd([0-9]+)$`)

// ParseDevice maps "/dev/nbdN" to N.
func ParseDevice(path string) (int, error) {
	m := devRE.FindStringSubmatch(path)
	if m == nil {
		return 0, fmt.Errorf("%q is not an NBD device (expected /dev/nbdN)", path)
	}
	n, err := strconv.Atoi(m[1])
	if err != nil || n > 1<<20 {
		return 0, fmt.Errorf("%q: device number out of range", path)
	}
	return n, nil
}

// connectAttrs encodes the NBD_CMD_CONNECT attributes.
func connectAttrs(c Config) ([]byte, error) {
	if len(c.Sockets) == 0 {
		return nil, errors.New("nbdkernel: no sockets to hand to the kernel")
	}
	if c.BlockSize < 512 || c.BlockSize&(c.BlockSize-1) != 0 {
		return nil, fmt.Errorf("nbdkernel: block size %d is not a power of two >= 512", c.BlockSize)
	}
	if c.Size == 0 || c.Size%c.BlockSize != 0 {
		return nil, fmt.Errorf("nbdkernel: size %d is not a positive multiple of the block size", c.Size)
	}
	ae := netlink.NewAttributeEncoder()
	if c.Index >= 0 {
		ae.Uint32(attrIndex, uint32(c.Index))
	}
	ae.Uint64(attrSizeBytes, c.Size)
	ae.Uint64(attrBlockSizeBytes, c.BlockSize)
	ae.Uint64(attrServerFlags, uint64(c.ServerFlags))
	ae.Uint64(attrClientFlags, clientFlagDestroyOnDisconnect)
	return encodeLink(ae, c)
}

// encodeLink adds what connect and reconfigure both send (timeouts, backend, sockets)
// and encodes the message.
func encodeLink(ae *netlink.AttributeEncoder, c Config) ([]byte, error) {
	if c.TimeoutSeconds > 0 {
		ae.Uint64(attrTimeout, c.TimeoutSeconds)
	}
	if c.DeadConnTimeoutSeconds > 0 {
		ae.Uint64(attrDeadConnTimeout, c.DeadConnTimeoutSeconds)
	}
	if c.Backend != "" {
		ae.String(attrBackend, c.Backend)
	}
	encodeSockets(ae, c.Sockets)
	return ae.Encode()
}

// reconfigureAttrs encodes NBD_CMD_RECONFIGURE: new sockets for a live device, and its
// size, which grows the device live when the volume was grown while the device waited
// (Linux 6.1 applies it; a kernel that ignores it keeps the old size). The block size
// stays the one of the original connect. The backend, when given, must match the one
// the device was connected with.
func reconfigureAttrs(c Config) ([]byte, error) {
	if c.Index < 0 {
		return nil, errors.New("nbdkernel: reconfigure needs a device index")
	}
	if len(c.Sockets) == 0 {
		return nil, errors.New("nbdkernel: no sockets to hand to the kernel")
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(c.Index))
	if c.Size > 0 {
		ae.Uint64(attrSizeBytes, c.Size)
	}
	return encodeLink(ae, c)
}

func encodeSockets(ae *netlink.AttributeEncoder, socks []*os.File) {
	ae.Nested(attrSockets, func(nae *netlink.AttributeEncoder) error {
		for _, f := range socks {
			nae.Nested(sockItem, func(iae *netlink.AttributeEncoder) error {
				iae.Uint32(sockFD, uint32(f.Fd()))
				return nil
			})
		}
		return nil
	})
}

func disconnectAttrs(index int) ([]byte, error) {
	if index < 0 {
		return nil, errors.New("nbdkernel: disconnect needs a device index")
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	return ae.Encode()
}

func execute(cmd uint8, attrs []byte) ([]genetlink.Message, error) {
	conn, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("open generic netlink: %w", err)
	}
	defer conn.Close()
	fam, err := conn.GetFamily(familyName)
	if err != nil {
		return nil, fmt.Errorf("kernel NBD driver not available (modprobe nbd?): %w", err)
	}
	msg := genetlink.Message{
		Header: genetlink.Header{Command: cmd, Version: fam.Version},
		Data:   attrs,
	}
	msgs, err := conn.Execute(msg, fam.ID, netlink.Request|netlink.Acknowledge)
	if err != nil {
		return nil, fmt.Errorf("kernel NBD driver: %w", err)
	}
	return msgs, nil
}

// Connect hands c.Sockets to the kernel and returns the device index it attached.
func Connect(c Config) (int, error) {
	attrs, err := connectAttrs(c)
	if err != nil {
		return 0, err
	}
	msgs, err := execute(cmdConnect, attrs)
	if err != nil {
		return 0, err
	}
	for _, m := range msgs {
		ad, err := netlink.NewAttributeDecoder(m.Data)
		if err != nil {
			continue
		}
		for ad.Next() {
			if ad.Type() == attrIndex {
				return int(ad.Uint32()), nil
			}
		}
	}
	if c.Index >= 0 {
		return c.Index, nil
	}
	return 0, errors.New("kernel NBD driver did not say which device it connected")
}

// Reconfigure hands new sockets to the live device /dev/nbd<c.Index>, replacing
// connections that died with their server; I/O the kernel held meanwhile resumes on them.
func Reconfigure(c Config) error {
	attrs, err := reconfigureAttrs(c)
	if err != nil {
		return err
	}
	_, err = execute(cmdReconfigure, attrs)
	return err
}

// Disconnect asks the kernel to disconnect /dev/nbd<index>; the kernel sends NBD_CMD_DISC
// to the server on each socket.
func Disconnect(index int) error {
	attrs, err := disconnectAttrs(index)
	if err != nil {
		return err
	}
	_, err = execute(cmdDisconnect, attrs)
	return err
}

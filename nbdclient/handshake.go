package nbdclient

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"

	"github.com/elidisk/eli/internal/nbdproto"
)

// handshakeConfig is what a caller asks of the newstyle negotiation.
type handshakeConfig struct {
	name       string
	tls        *tls.Config // non-nil: NBD_OPT_STARTTLS first, and fail if the server refuses
	structured bool        // ask for structured replies (NBD_OPT_STRUCTURED_REPLY)
}

// negotiated is what the negotiation settled: the connection to use from now on (a TLS
// connection after STARTTLS), the export, and whether replies are structured.
type negotiated struct {
	conn       net.Conn
	export     Export
	structured bool
}

// negotiate runs the fixed newstyle handshake on conn up to the transmission phase. The
// context bounds the whole exchange (it sets the connection's deadline and clears it on
// success).
func negotiate(ctx context.Context, conn net.Conn, cfg handshakeConfig) (negotiated, error) {
	if len(cfg.name) > 4096 {
		return negotiated{}, errors.New("nbd: export name longer than 4096 bytes")
	}
	if d, ok := ctx.Deadline(); ok {
		conn.SetDeadline(d)
		defer conn.SetDeadline(timeZero)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(timePast) })
	defer stop()

	var greet [18]byte
	if _, err := io.ReadFull(conn, greet[:]); err != nil {
		return negotiated{}, fmt.Errorf("nbd handshake: read greeting: %w", err)
	}
	if binary.BigEndian.Uint64(greet[0:]) != nbdproto.MagicNBD || binary.BigEndian.Uint64(greet[8:]) != nbdproto.MagicOpt {
		return negotiated{}, errors.New("nbd handshake: server is not a newstyle NBD server")
	}
	hflags := binary.BigEndian.Uint16(greet[16:])
	if hflags&nbdproto.FlagFixedNewstyle == 0 {
		return negotiated{}, errors.New("nbd handshake: server does not support fixed newstyle")
	}
	cflags := uint32(nbdproto.FlagCFixedNewstyle)
	if hflags&nbdproto.FlagNoZeroes != 0 {
		cflags |= nbdproto.FlagCNoZeroes
	}
	if err := binary.Write(conn, binary.BigEndian, cflags); err != nil {
		return negotiated{}, fmt.Errorf("nbd handshake: %w", err)
	}

	if cfg.tls != nil {
		if err := writeOption(conn, nbdproto.OptStartTLS, nil); err != nil {
			return negotiated{}, err
		}
		typ, payload, err := readOptReply(conn, nbdproto.OptStartTLS)
		if err != nil {
			return negotiated{}, err
		}
		if typ != nbdproto.RepAck {
			return negotiated{}, fmt.Errorf("nbd handshake: server refused STARTTLS: %s", optErr(typ, payload))
		}
		tc := tls.Client(conn, cfg.tls)
		if err := tc.HandshakeContext(ctx); err != nil {
			return negotiated{}, fmt.Errorf("nbd handshake: TLS: %w", err)
		}
		conn = tc
	}

	n := negotiated{conn: conn}
	if cfg.structured {
		if err := writeOption(conn, nbdproto.OptStructuredReply, nil); err != nil {
			return negotiated{}, err
		}
		typ, payload, err := readOptReply(conn, nbdproto.OptStructuredReply)
		if err != nil {
			return negotiated{}, err
		}
		switch {
		case typ == nbdproto.RepAck:
			n.structured = true
		case typ&nbdproto.RepFlagError != 0:
			// Simple replies then: the server's right (proto.md, NBD_OPT_STRUCTURED_REPLY).
		default:
			return negotiated{}, fmt.Errorf("nbd handshake: unexpected reply %#x to NBD_OPT_STRUCTURED_REPLY (%d bytes)", typ, len(payload))
		}
	}

	// NBD_OPT_GO: name, then the one info request beyond the mandatory NBD_INFO_EXPORT.
	data := make([]byte, 0, 4+len(cfg.name)+4)
	data = binary.BigEndian.AppendUint32(data, uint32(len(cfg.name)))
	data = append(data, cfg.name...)
	data = binary.BigEndian.AppendUint16(data, 1)
	data = binary.BigEndian.AppendUint16(data, nbdproto.InfoBlockSize)
	if err := writeOption(conn, nbdproto.OptGo, data); err != nil {
		return negotiated{}, err
	}
	gotExport := false
	for {
		typ, payload, err := readOptReply(conn, nbdproto.OptGo)
		if err != nil {
			return negotiated{}, err
		}
		switch {
		case typ == nbdproto.RepAck:
			if !gotExport {
				return negotiated{}, errors.New("nbd handshake: server acknowledged NBD_OPT_GO without NBD_INFO_EXPORT")
			}
			if err := n.export.check(); err != nil {
				return negotiated{}, err
			}
			return n, nil
		case typ == nbdproto.RepInfo:
			if len(payload) < 2 {
				return negotiated{}, errors.New("nbd handshake: short NBD_REP_INFO")
			}
			switch binary.BigEndian.Uint16(payload) {
			case nbdproto.InfoExport:
				if len(payload) != nbdproto.InfoExportPayloadLen {
					return negotiated{}, errors.New("nbd handshake: bad NBD_INFO_EXPORT length")
				}
				n.export.Size = binary.BigEndian.Uint64(payload[2:])
				n.export.Flags = binary.BigEndian.Uint16(payload[10:])
				gotExport = true
			case nbdproto.InfoBlockSize:
				if len(payload) != nbdproto.InfoBlockPayloadLen {
					return negotiated{}, errors.New("nbd handshake: bad NBD_INFO_BLOCK_SIZE length")
				}
				n.export.MinBlock = binary.BigEndian.Uint32(payload[2:])
				n.export.PreferredBlock = binary.BigEndian.Uint32(payload[6:])
				n.export.MaxBlock = binary.BigEndian.Uint32(payload[10:])
			}
		case typ&nbdproto.RepFlagError != 0:
			return negotiated{}, fmt.Errorf("nbd handshake: server refused export %q: %s", cfg.name, optErr(typ, payload))
		default:
			// Unknown reply types without the error bit may be ignored (proto.md).
		}
	}
}

// check bounds what the server said before anything trusts it.
func (e *Export) check() error {
	if e.Size > math.MaxInt64 {
		return fmt.Errorf("nbd handshake: export size %d does not fit in int64", e.Size)
	}
	if e.MinBlock == 0 && e.PreferredBlock == 0 && e.MaxBlock == 0 {
		return nil // no NBD_INFO_BLOCK_SIZE: any alignment, payloads up to 32 MiB
	}
	pow2 := func(v uint32) bool { return v != 0 && v&(v-1) == 0 }
	// proto.md "Block size constraints": minimum a power of two up to 64 KiB, preferred a
	// power of two at least the minimum, maximum a multiple of the minimum (or 0xffffffff).
	if !pow2(e.MinBlock) || e.MinBlock > 64<<10 {
		return fmt.Errorf("nbd handshake: bad minimum block size %d", e.MinBlock)
	}
	if !pow2(e.PreferredBlock) || e.PreferredBlock < e.MinBlock {
		return fmt.Errorf("nbd handshake: bad preferred block size %d", e.PreferredBlock)
	}
	if e.MaxBlock < e.MinBlock || (e.MaxBlock != math.MaxUint32 && e.MaxBlock%e.MinBlock != 0) {
		return fmt.Errorf("nbd handshake: bad maximum block size %d", e.MaxBlock)
	}
	return nil
}

// maxPayload is the largest request length this client sends to the export: the server's
// maximum, capped at MaxRequest, rounded down to the minimum block size.
func (e *Export) maxPayload() uint32 {
	m := uint32(MaxRequest)
	if e.MaxBlock != 0 && e.MaxBlock < m {
		m = e.MaxBlock
	}
	if e.MinBlock > 1 {
		m -= m % e.MinBlock
	}
	return m
}

func optErr(typ uint32, payload []byte) string {
	msg := string(payload)
	if msg == "" {
		switch typ {
		case nbdproto.RepErrTLSReqd:
			msg = "TLS required"
		case nbdproto.RepErrUnsup:
			msg = "unsupported"
		case nbdproto.RepErrPolicy:
			msg = "forbidden by policy"
		case nbdproto.RepErrUnknown:
			msg = "unknown export"
		default:
			msg = fmt.Sprintf("error %#x", typ)
		}
	}
	return msg
}

func writeOption(w io.Writer, opt uint32, data []byte) error {
	buf := make([]byte, nbdproto.OptionHeaderLen+len(data))
	binary.BigEndian.PutUint64(buf, nbdproto.MagicOpt)
	binary.BigEndian.PutUint32(buf[8:], opt)
	binary.BigEndian.PutUint32(buf[12:], uint32(len(data)))
	copy(buf[16:], data)
	if _, err := w.Write(buf); err != nil {
		return fmt.Errorf("nbd handshake: send option: %w", err)
	}
	return nil
}

func readOptReply(r io.Reader, opt uint32) (uint32, []byte, error) {
	var h [nbdproto.OptionReplyHeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, fmt.Errorf("nbd handshake: read option reply: %w", err)
	}
	if binary.BigEndian.Uint64(h[0:]) != nbdproto.MagicOptReply {
		return 0, nil, errors.New("nbd handshake: bad option reply magic")
	}
	if got := binary.BigEndian.Uint32(h[8:]); got != opt {
		return 0, nil, fmt.Errorf("nbd handshake: reply for option %d, expected %d", got, opt)
	}
	typ := binary.BigEndian.Uint32(h[12:])
	n := binary.BigEndian.Uint32(h[16:])
	if n > maxOptReply {
		return 0, nil, fmt.Errorf("nbd handshake: option reply of %d bytes is too long", n)
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, nil, fmt.Errorf("nbd handshake: read option reply: %w", err)
	}
	return typ, payload, nil
}

// putRequest encodes a request header (proto.md "Request message") into h[:28].
func putRequest(h []byte, flags, cmd uint16, cookie, off uint64, length uint32) {
	binary.BigEndian.PutUint32(h[0:], nbdproto.MagicRequest)
	binary.BigEndian.PutUint16(h[4:], flags)
	binary.BigEndian.PutUint16(h[6:], cmd)
	binary.BigEndian.PutUint64(h[8:], cookie)
	binary.BigEndian.PutUint64(h[16:], off)
	binary.BigEndian.PutUint32(h[24:], length)
}

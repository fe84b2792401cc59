package nbd

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/elidisk/eli/internal/nbdproto"
)

// protocolError ends a connection for a reason worth a warning in the log: the client
// broke the protocol, or TLS failed.
type protocolError struct{ msg string }

func (e *protocolError) Error() string { return e.msg }

func protoErrorf(format string, args ...any) error {
	return &protocolError{"protocol error: " + fmt.Sprintf(format, args...)}
}

var errClientAbort = errors.New("client sent NBD_OPT_ABORT")

// negotiated is what the handshake settles: the client's dialect, the formats of requests
// and replies, the metadata context and the export. Transmission reads it and never
// changes it.
type negotiated struct {
	fixed      bool // the client speaks fixed newstyle
	tlsUp      bool
	structured bool
	extended   bool   // NBD_OPT_EXTENDED_HEADERS: 32-byte requests and replies
	metaID     uint32 // base:allocation's context ID once selected, else 0
	metaExport string // the export NBD_OPT_SET_META_CONTEXT named
	exp        *export
	optBuf     []byte // option data, reused from option to option; nil in transmission
}

// optData is room for an option's n bytes of data (at most maxOptionData).
func (n *negotiated) optData(length uint32) []byte {
	if cap(n.optBuf) < int(length) {
		n.optBuf = make([]byte, length, maxOptionData)
	}
	return n.optBuf[:length]
}

// useStructured turns on structured replies (NBD_OPT_STRUCTURED_REPLY), or returns the
// error reply that refuses them.
func (n *negotiated) useStructured() (uint32, string) {
	if n.extended {
		return nbdproto.RepErrExtHeaderReqd, "extended headers are already in use"
	}
	n.structured = true
	return 0, ""
}

// useExtended turns on extended headers (NBD_OPT_EXTENDED_HEADERS), or returns the error
// reply that refuses them.
func (n *negotiated) useExtended() (uint32, string) {
	if n.extended {
		return nbdproto.RepErrInvalid, "extended headers are already in use"
	}
	// Extended headers imply structured replies (proto.md "Extended headers").
	n.extended, n.structured = true, true
	return 0, ""
}

// tlsStarted records the TLS upgrade and drops the rest, as proto.md requires ("the
// server MUST NOT preserve any negotiation state").
func (n *negotiated) tlsStarted() {
	n.tlsUp = true
	n.structured, n.extended, n.metaID, n.metaExport = false, false, 0, ""
}

// selectMeta records the metadata context NBD_OPT_SET_META_CONTEXT selected for the export
// named name: id, or none if id is 0.
func (n *negotiated) selectMeta(id uint32, name string) { n.metaID, n.metaExport = id, name }

// useExport records the export chosen for transmission, and drops a context selected for
// another export: its ID means nothing there (proto.md "NBD_OPT_SET_META_CONTEXT").
func (n *negotiated) useExport(x *export) {
	n.exp = x
	if n.metaID != 0 && n.metaExport != x.Name {
		n.selectMeta(0, "")
	}
}

// handshake runs the fixed newstyle negotiation (proto.md "Fixed newstyle negotiation") up
// to the transmission phase; on success c.exp is the chosen export. It holds at most
// maxOptionData bytes of option data, and the whole of it is bounded by the handshake
// timeout and maxOptions.
func (c *conn) handshake() error {
	deadline := time.Now().Add(c.s.handshakeTimeout())
	if err := c.nc.SetWriteDeadline(deadline); err != nil {
		return fmt.Errorf("set handshake deadline: %w", err)
	}
	c.setReadDeadline(deadline)
	var g [18]byte
	binary.BigEndian.PutUint64(g[0:], nbdproto.MagicNBD)
	binary.BigEndian.PutUint64(g[8:], nbdproto.MagicOpt)
	binary.BigEndian.PutUint16(g[16:], nbdproto.FlagFixedNewstyle|nbdproto.FlagNoZeroes)
	if _, err := c.rw.Write(g[:]); err != nil {
		return fmt.Errorf("send greeting: %w", err)
	}
	var cf [4]byte
	if _, err := io.ReadFull(c.rw, cf[:]); err != nil {
		return fmt.Errorf("read client flags: %w", err)
	}
	clientFlags := binary.BigEndian.Uint32(cf[:])
	if clientFlags&^(nbdproto.FlagCFixedNewstyle|nbdproto.FlagCNoZeroes) != 0 {
		// proto.md: "the server MUST drop the TCP connection if the client sets an
		// unknown flag".
		return protoErrorf("unknown client flags %#x", clientFlags)
	}
	// A client without NBD_FLAG_C_FIXED_NEWSTYLE speaks plain newstyle: it may only send
	// NBD_OPT_EXPORT_NAME, and gets no option replies.
	c.fixed = clientFlags&nbdproto.FlagCFixedNewstyle != 0
	noZeroes := clientFlags&nbdproto.FlagCNoZeroes != 0

	for n := 0; ; n++ {
		if n == maxOptions {
			return protoErrorf("more than %d options", maxOptions)
		}
		var h [nbdproto.OptionHeaderLen]byte
		if _, err := io.ReadFull(c.rw, h[:]); err != nil {
			return fmt.Errorf("read option: %w", err)
		}
		if m := binary.BigEndian.Uint64(h[0:]); m != nbdproto.MagicOpt {
			return protoErrorf("bad option magic %#016x", m)
		}
		opt := binary.BigEndian.Uint32(h[8:])
		length := binary.BigEndian.Uint32(h[12:])
		if length > maxOptionSkip {
			// proto.md lets a server hard-disconnect a client whose behaviour it deems
			// a denial of service; no option this server knows comes near this size.
			return protoErrorf("option %d carries %d bytes of data", opt, length)
		}
		if !c.fixed && opt != nbdproto.OptExportName {
			// Without fixed newstyle there is no way to refuse an option but to close.
			return protoErrorf("option %d from a client that does not speak fixed newstyle", opt)
		}
		if length > maxOptionData {
			if _, err := io.CopyN(io.Discard, c.rw, int64(length)); err != nil {
				return fmt.Errorf("skip option data: %w", err)
			}
			if opt == nbdproto.OptExportName {
				return protoErrorf("NBD_OPT_EXPORT_NAME with a %d-byte name", length)
			}
			if err := c.optReply(opt, nbdproto.RepErrTooBig, []byte(fmt.Sprintf("option data of %d bytes is too long", length))); err != nil {
				return err
			}
			continue
		}
		data := c.optData(length)
		if _, err := io.ReadFull(c.rw, data); err != nil {
			return fmt.Errorf("read option data: %w", err)
		}
		done, err := c.option(opt, data, noZeroes)
		if err != nil || done {
			if err == nil {
				c.optBuf = nil
				c.setReadDeadline(time.Time{})
				err = c.nc.SetWriteDeadline(time.Time{})
			}
			return err
		}
	}
}

// option handles one option; done reports that the transmission phase begins.
func (c *conn) option(opt uint32, data []byte, noZeroes bool) (done bool, err error) {
	if c.stopping.Load() && opt != nbdproto.OptAbort {
		// proto.md: a server being shut down SHOULD error further options (other
		// than NBD_OPT_ABORT) with NBD_REP_ERR_SHUTDOWN.
		if opt == nbdproto.OptExportName {
			return false, errors.New("NBD_OPT_EXPORT_NAME while the server is shutting down")
		}
		return false, c.optError(opt, nbdproto.RepErrShutdown, "the server is shutting down")
	}
	if c.s.TLSConfig != nil && !c.tlsUp && opt != nbdproto.OptStartTLS && opt != nbdproto.OptAbort {
		// FORCEDTLS (proto.md "FORCEDTLS mode").
		if opt == nbdproto.OptExportName {
			return false, protoErrorf("NBD_OPT_EXPORT_NAME before TLS on a server that requires TLS")
		}
		return false, c.optError(opt, nbdproto.RepErrTLSReqd, "TLS is required: send NBD_OPT_STARTTLS first")
	}
	switch opt {
	case nbdproto.OptExportName:
		return true, c.exportName(data, noZeroes)
	case nbdproto.OptAbort:
		// Reply, as proto.md asks, but the client may already be gone.
		_ = c.optReply(opt, nbdproto.RepAck, nil)
		return false, errClientAbort
	case nbdproto.OptList:
		if len(data) != 0 {
			return false, c.optError(opt, nbdproto.RepErrInvalid, "NBD_OPT_LIST takes no data")
		}
		for _, x := range c.s.table.list {
			p := make([]byte, 4, 4+len(x.Name)+len(x.Description))
			binary.BigEndian.PutUint32(p, uint32(len(x.Name)))
			p = append(append(p, x.Name...), x.Description...)
			if err := c.optReply(opt, nbdproto.RepServer, p); err != nil {
				return false, err
			}
		}
		return false, c.optReply(opt, nbdproto.RepAck, nil)
	case nbdproto.OptStartTLS:
		return false, c.startTLS(data)
	case nbdproto.OptInfo, nbdproto.OptGo:
		return c.infoGo(opt, data)
	case nbdproto.OptStructuredReply:
		if len(data) != 0 {
			return false, c.optError(opt, nbdproto.RepErrInvalid, "NBD_OPT_STRUCTURED_REPLY takes no data")
		}
		if typ, msg := c.useStructured(); typ != 0 {
			return false, c.optError(opt, typ, msg)
		}
		return false, c.optReply(opt, nbdproto.RepAck, nil)
	case nbdproto.OptExtendedHeaders:
		if len(data) != 0 {
			return false, c.optError(opt, nbdproto.RepErrInvalid, "NBD_OPT_EXTENDED_HEADERS takes no data")
		}
		if typ, msg := c.useExtended(); typ != 0 {
			return false, c.optError(opt, typ, msg)
		}
		return false, c.optReply(opt, nbdproto.RepAck, nil)
	case nbdproto.OptListMetaContext, nbdproto.OptSetMetaContext:
		return false, c.metaContext(opt, data)
	}
	return false, c.optError(opt, nbdproto.RepErrUnsup, fmt.Sprintf("option %d is not supported", opt))
}

func (c *conn) exportName(name []byte, noZeroes bool) error {
	if c.extended {
		// Its reply has no room to say no; proto.md forbids it with extended headers.
		return protoErrorf("NBD_OPT_EXPORT_NAME after NBD_OPT_EXTENDED_HEADERS")
	}
	if len(name) > maxString {
		return protoErrorf("export name of %d bytes", len(name))
	}
	x, ok := c.s.table.byName[string(name)]
	if !ok {
		// NBD_OPT_EXPORT_NAME cannot fail with a reply: the session ends.
		return protoErrorf("NBD_OPT_EXPORT_NAME for unknown export %q", wireMessage(string(name)))
	}
	if !c.s.enterTransmission(c) {
		return errors.New("NBD_OPT_EXPORT_NAME while the server is shutting down")
	}
	c.useExport(x)
	b := make([]byte, 10, 10+nbdproto.ExportNameReplyZeroes)
	binary.BigEndian.PutUint64(b[0:], uint64(x.size))
	binary.BigEndian.PutUint16(b[8:], x.flags(c.structured))
	if !noZeroes {
		b = b[:10+nbdproto.ExportNameReplyZeroes]
	}
	if _, err := c.rw.Write(b); err != nil {
		return fmt.Errorf("send export info: %w", err)
	}
	return nil
}

// infoGo answers NBD_OPT_INFO and NBD_OPT_GO (proto.md "NBD_OPT_INFO (6) and NBD_OPT_GO
// (7)"). The server sends NBD_INFO_EXPORT and NBD_INFO_BLOCK_SIZE always, and the name
// and description when asked.
func (c *conn) infoGo(opt uint32, data []byte) (bool, error) {
	if len(data) < 6 {
		return false, c.optError(opt, nbdproto.RepErrInvalid, "option data too short")
	}
	nameLen := binary.BigEndian.Uint32(data)
	if nameLen > uint32(len(data)-6) {
		return false, c.optError(opt, nbdproto.RepErrInvalid, "export name length exceeds the option data")
	}
	name := data[4 : 4+nameLen]
	rest := data[4+nameLen:]
	nreq := int(binary.BigEndian.Uint16(rest))
	if len(rest) != 2+2*nreq {
		return false, c.optError(opt, nbdproto.RepErrInvalid, "information request count does not match the option data")
	}
	if len(name) > maxString {
		return false, c.optError(opt, nbdproto.RepErrInvalid, fmt.Sprintf("export name of %d bytes exceeds %d", len(name), maxString))
	}
	var wantName, wantDesc bool
	for i := range nreq {
		switch binary.BigEndian.Uint16(rest[2+2*i:]) {
		case nbdproto.InfoName:
			wantName = true
		case nbdproto.InfoDescription:
			wantDesc = true
		}
	}
	x, ok := c.s.table.byName[string(name)]
	if !ok {
		return false, c.optError(opt, nbdproto.RepErrUnknown, fmt.Sprintf("no export named %q", wireMessage(string(name))))
	}

	var p [nbdproto.InfoBlockPayloadLen]byte
	binary.BigEndian.PutUint16(p[0:], nbdproto.InfoExport)
	binary.BigEndian.PutUint64(p[2:], uint64(x.size))
	binary.BigEndian.PutUint16(p[10:], x.flags(c.structured))
	if err := c.optReply(opt, nbdproto.RepInfo, p[:nbdproto.InfoExportPayloadLen]); err != nil {
		return false, err
	}
	binary.BigEndian.PutUint16(p[0:], nbdproto.InfoBlockSize)
	binary.BigEndian.PutUint32(p[2:], x.minBlock)
	binary.BigEndian.PutUint32(p[6:], x.prefBlock)
	binary.BigEndian.PutUint32(p[10:], x.max)
	if err := c.optReply(opt, nbdproto.RepInfo, p[:nbdproto.InfoBlockPayloadLen]); err != nil {
		return false, err
	}
	if wantName {
		if err := c.optReply(opt, nbdproto.RepInfo, infoString(nbdproto.InfoName, x.Name)); err != nil {
			return false, err
		}
	}
	if wantDesc && x.Description != "" {
		if err := c.optReply(opt, nbdproto.RepInfo, infoString(nbdproto.InfoDescription, x.Description)); err != nil {
			return false, err
		}
	}
	if opt == nbdproto.OptGo && !c.s.enterTransmission(c) {
		return false, c.optError(opt, nbdproto.RepErrShutdown, "the server is shutting down")
	}
	if err := c.optReply(opt, nbdproto.RepAck, nil); err != nil {
		return false, err
	}
	if opt == nbdproto.OptGo {
		c.useExport(x)
		return true, nil
	}
	return false, nil
}

func infoString(typ uint16, s string) []byte {
	b := make([]byte, 2, 2+len(s))
	binary.BigEndian.PutUint16(b, typ)
	return append(b, s...)
}

// startTLS answers NBD_OPT_STARTTLS and upgrades the connection.
func (c *conn) startTLS(data []byte) error {
	const opt = nbdproto.OptStartTLS
	switch {
	case c.s.TLSConfig == nil:
		return c.optError(opt, nbdproto.RepErrPolicy, "TLS is not configured on this server")
	case c.tlsUp:
		return c.optError(opt, nbdproto.RepErrInvalid, "TLS is already running")
	case len(data) != 0:
		return c.optError(opt, nbdproto.RepErrInvalid, "NBD_OPT_STARTTLS takes no data")
	}
	if err := c.optReply(opt, nbdproto.RepAck, nil); err != nil {
		return err
	}
	tc := tls.Server(c.rw, c.s.tls)
	// The connection's handshake deadline still bounds the TLS handshake.
	if err := tc.HandshakeContext(context.Background()); err != nil {
		return &protocolError{"TLS handshake failed: " + err.Error()}
	}
	c.rw = tc
	c.tlsStarted()
	return nil
}

// baseAllocationID is the context ID of base:allocation, the one metadata context.
const baseAllocationID = 1

// metaContext answers NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT (proto.md
// "Metadata querying"). The one context is base:allocation; a LIST without queries, or
// with the query "base:", lists it. The option data is: export name (32-bit length and
// bytes), number of queries (32 bits), each query (32-bit length and bytes).
func (c *conn) metaContext(opt uint32, data []byte) error {
	set := opt == nbdproto.OptSetMetaContext
	if set {
		// A new selection replaces the old one, even if it fails.
		c.selectMeta(0, "")
		if !c.structured {
			return c.optError(opt, nbdproto.RepErrInvalid, "NBD_OPT_SET_META_CONTEXT needs structured replies or extended headers first")
		}
	}
	bad := func(what string) error { return c.optError(opt, nbdproto.RepErrInvalid, what) }
	if len(data) < 8 {
		return bad("option data too short")
	}
	nameLen := binary.BigEndian.Uint32(data)
	if uint64(nameLen) > uint64(len(data)-8) {
		return bad("export name length exceeds the option data")
	}
	name := string(data[4 : 4+nameLen])
	rest := data[4+nameLen:]
	nq := binary.BigEndian.Uint32(rest)
	rest = rest[4:]
	var queries []string
	for range nq {
		if len(rest) < 4 {
			return bad("query count exceeds the option data")
		}
		ql := binary.BigEndian.Uint32(rest)
		if uint64(ql) > uint64(len(rest)-4) {
			return bad("query length exceeds the option data")
		}
		queries = append(queries, string(rest[4:4+ql]))
		rest = rest[4+ql:]
	}
	if len(rest) != 0 {
		return bad("trailing bytes after the queries")
	}
	if _, ok := c.s.table.byName[name]; !ok {
		return c.optError(opt, nbdproto.RepErrUnknown, fmt.Sprintf("no export named %q", wireMessage(name)))
	}
	match := !set && len(queries) == 0
	for _, q := range queries {
		if q == nbdproto.MetaBaseAllocation || (!set && q == "base:") {
			match = true
		}
	}
	if match {
		var id uint32 // LIST replies carry no ID (proto.md: the server SHOULD send 0)
		if set {
			id = baseAllocationID
			c.selectMeta(id, name)
		}
		p := binary.BigEndian.AppendUint32(nil, id)
		if err := c.optReply(opt, nbdproto.RepMetaContext, append(p, nbdproto.MetaBaseAllocation...)); err != nil {
			return err
		}
	}
	return c.optReply(opt, nbdproto.RepAck, nil)
}

func (c *conn) optError(opt, typ uint32, msg string) error {
	return c.optReply(opt, typ, []byte(wireMessage(msg)))
}

func (c *conn) optReply(opt, typ uint32, data []byte) error {
	b := make([]byte, nbdproto.OptionReplyHeaderLen, nbdproto.OptionReplyHeaderLen+len(data))
	binary.BigEndian.PutUint64(b[0:], nbdproto.MagicOptReply)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], typ)
	binary.BigEndian.PutUint32(b[16:], uint32(len(data)))
	if _, err := c.rw.Write(append(b, data...)); err != nil {
		return fmt.Errorf("send option reply: %w", err)
	}
	return nil
}

// Package faultproxy is an NBD proxy for tests: it sits between an NBD client and the
// storage's NBD server and puts the faults of real storage between them, on command:
// the storage killed (nothing listens any more) and restarted on the same address, every
// byte held both ways (a stalled server or network), connections cut, writes or a share
// of reads answered with EIO, and the export swapped for another server's.
//
// It understands just enough of the protocol (NetworkBlockDevice/nbd doc/proto.md) to
// answer a request itself between two of the server's replies: the fixed newstyle
// handshake, option by option (whether structured replies were negotiated decides how a
// READ may fail: proto.md forbids a simple reply to a READ then), and in transmission the
// request headers and payloads one way, simple replies and structured reply chunks the
// other. It needs the client to negotiate one option at a time, as eli's nbdclient,
// libnbd and qemu do, and refuses what it cannot see through: TLS (NBD_OPT_STARTTLS) and
// extended headers (a client offered those gets its connection closed).
package faultproxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Protocol constants (proto.md).
const (
	magicNBD        = 0x4e42444d41474943 // "NBDMAGIC"
	magicOpt        = 0x49484156454F5054 // "IHAVEOPT"
	magicOptReply   = 0x0003e889045565a9
	magicRequest    = 0x25609513
	magicSimple     = 0x67446698
	magicStructured = 0x668e33ef

	optExportName = 1
	optStartTLS   = 5
	optGo         = 7
	optStructured = 8
	optExtended   = 11

	repAck       = 1
	repFlagError = 1 << 31

	clientNoZeroes = 1 << 1

	cmdRead        = 0
	cmdWrite       = 1
	cmdDisc        = 2
	cmdTrim        = 4
	cmdWriteZeroes = 6

	replyFlagDone = 1 << 0
	chunkError    = 1<<15 | 1 // NBD_REPLY_TYPE_ERROR

	errEIO = 5

	// maxPayload bounds what is read of one request's or reply's payload, and maxOption
	// one option's data: the proxy trusts neither side more than a server would.
	maxPayload = 64<<20 + 64
	maxOption  = 1 << 20
)

// Proxy relays NBD connections from its listener to the upstream server, with faults.
// The zero value is not usable; New makes one.
type Proxy struct {
	logf func(string, ...any)

	mu        sync.Mutex
	network   string // where it listens
	addr      string
	ln        net.Listener
	upNet     string // the upstream server
	upAddr    string
	conns     map[*conn]struct{}
	stall     chan struct{} // non-nil while stalled: closed by Resume
	failWrite bool
	readRate  float64
	rng       *rand.Rand
	closed    bool

	accepted, injected, cuts atomic.Int64
}

// New makes a proxy to the NBD server at upstream (network "unix" or "tcp"). logf, if
// not nil, hears what the proxy refuses.
func New(upNetwork, upAddr string, logf func(string, ...any)) *Proxy {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	return &Proxy{logf: logf, upNet: upNetwork, upAddr: upAddr, conns: make(map[*conn]struct{}),
		rng: rand.New(rand.NewPCG(38, 1))}
}

// Listen starts accepting on network and addr ("unix" and a path, or "tcp" and
// "127.0.0.1:0"), the address Kill stops and Restart takes again.
func (p *Proxy) Listen(network, addr string) error {
	if network == "unix" {
		os.Remove(addr) // a killed proxy's socket
	}
	ln, err := net.Listen(network, addr)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		ln.Close()
		return errors.New("faultproxy: closed")
	}
	p.network, p.addr, p.ln = network, ln.Addr().String(), ln
	go p.accept(ln)
	return nil
}

// Addr is the address the proxy listens on (or did, before Kill).
func (p *Proxy) Addr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addr
}

// Kill is the storage gone: nothing listens at the address any more (a unix socket's
// file is removed), and every connection is dropped.
func (p *Proxy) Kill() {
	p.mu.Lock()
	ln := p.ln
	p.ln = nil
	p.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	p.Cut()
}

// Restart listens again at the address Kill gave up: the storage is back.
func (p *Proxy) Restart() error {
	p.mu.Lock()
	network, addr, up := p.network, p.addr, p.ln != nil
	p.mu.Unlock()
	if up {
		return nil
	}
	return p.Listen(network, addr)
}

// Cut drops every connection, as a network that resets them; new ones are accepted.
func (p *Proxy) Cut() {
	p.mu.Lock()
	conns := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	if len(conns) > 0 {
		p.cuts.Add(1)
	}
	for _, c := range conns {
		c.close()
	}
}

// CutEvery cuts every connection each interval until stop is closed.
func (p *Proxy) CutEvery(interval time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			p.Cut()
		}
	}
}

// Stall holds every byte both ways, on the connections there are and on new ones (which
// are accepted but not answered), until Resume: a server or a network that stopped.
func (p *Proxy) Stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stall == nil {
		p.stall = make(chan struct{})
	}
}

// Resume lets the bytes held since Stall through.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stall != nil {
		close(p.stall)
		p.stall = nil
	}
}

// FailWrites makes the proxy answer every WRITE, WRITE_ZEROES and TRIM with EIO instead
// of passing it on (a storage whose writes fail), or stop doing so.
func (p *Proxy) FailWrites(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failWrite = on
}

// FailReads makes the proxy answer that share of READs (0 to 1) with EIO, drawn from a
// seeded generator so that a test repeats.
func (p *Proxy) FailReads(rate float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.readRate = rate
}

// Upstream is the address of the server new connections go to.
func (p *Proxy) Upstream() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.upAddr
}

// SetUpstream sends new connections to another server: with Cut, the export replaced.
func (p *Proxy) SetUpstream(network, addr string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.upNet, p.upAddr = network, addr
}

// Stats count what the proxy did.
type Stats struct {
	Accepted int64 // connections accepted
	Live     int   // connections open now
	Injected int64 // requests answered with an error by the proxy
	Cuts     int64 // times Cut dropped connections
}

// Stats is what the proxy did so far.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	live := len(p.conns)
	p.mu.Unlock()
	return Stats{Accepted: p.accepted.Load(), Live: live, Injected: p.injected.Load(), Cuts: p.cuts.Load()}
}

// Close stops the proxy for good, and lets stalled bytes go (to closed connections).
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.Kill()
	p.Resume()
}

func (p *Proxy) accept(ln net.Listener) {
	for {
		cc, err := ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		p.mu.Lock()
		upNet, upAddr := p.upNet, p.upAddr
		p.mu.Unlock()
		sc, err := net.DialTimeout(upNet, upAddr, 10*time.Second)
		if err != nil {
			p.logf("faultproxy: upstream %s: %v", upAddr, err)
			cc.Close()
			continue
		}
		c := &conn{p: p, client: cc, server: sc, reqs: make(map[uint64]request), opts: make(chan option, 16),
			done: make(chan struct{}), drained: make(chan struct{})}
		p.mu.Lock()
		if p.ln != ln { // killed meanwhile
			p.mu.Unlock()
			c.close()
			continue
		}
		p.conns[c] = struct{}{}
		p.mu.Unlock()
		go c.clientToServer()
		go c.serverToClient()
	}
}

// gate waits while the proxy is stalled; false once the connection is closed.
func (c *conn) gate() bool {
	for {
		c.p.mu.Lock()
		stall := c.p.stall
		c.p.mu.Unlock()
		if stall == nil {
			select {
			case <-c.done:
				return false
			default:
				return true
			}
		}
		select {
		case <-stall:
		case <-c.done:
			return false
		}
	}
}

// conn is one client connection and its connection to the server.
type conn struct {
	p              *Proxy
	client, server net.Conn
	wmu            sync.Mutex // whole replies to the client

	mu         sync.Mutex
	reqs       map[uint64]request // requests sent to the server and not yet answered, by cookie
	structured bool

	opts      chan option // options sent to the server, whose replies serverToClient reads
	done      chan struct{}
	drained   chan struct{} // closed when serverToClient reads no more
	closeOnce sync.Once
}

type request struct {
	read   bool
	length uint32 // of a READ: the data a simple reply carries
}

type option struct {
	code     uint32
	noZeroes bool // for NBD_OPT_EXPORT_NAME: the client asked for no 124 zero bytes
}

// close drops the client's connection at once; the server's follows once the server has
// answered what it was sent (serverToClient reads and drops the replies), or after
// drainWait: nbdkit (1.32) can abort on an assertion when a connection closes while it
// still writes replies, and a storage server that crashed is not the fault a test asks
// for.
func (c *conn) close() {
	c.closeOnce.Do(func() {
		close(c.done)
		c.client.Close()
		c.p.mu.Lock()
		delete(c.p.conns, c)
		c.p.mu.Unlock()
		go func() {
			select {
			case <-c.drained:
			case <-time.After(drainWait):
			}
			c.server.Close()
		}()
	})
}

// drainWait bounds how long a dropped connection's server side waits for its replies.
const drainWait = 5 * time.Second

// closed reports whether close has run.
func (c *conn) closed() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// clientToServer relays the client's handshake, then its requests, answering those the
// faults say fail.
func (c *conn) clientToServer() {
	defer c.close()
	var flags [4]byte
	if !c.gate() || readFull(c.client, flags[:]) != nil || !c.gate() || write(c.server, flags[:]) != nil {
		return
	}
	noZeroes := binary.BigEndian.Uint32(flags[:])&clientNoZeroes != 0
	for {
		var m [4]byte
		if !c.gate() || readFull(c.client, m[:]) != nil {
			return
		}
		if binary.BigEndian.Uint32(m[:]) == magicRequest {
			c.requests(m)
			return
		}
		var h [16]byte
		copy(h[:], m[:])
		if readFull(c.client, h[4:]) != nil || binary.BigEndian.Uint64(h[:]) != magicOpt {
			return
		}
		code, n := binary.BigEndian.Uint32(h[8:]), binary.BigEndian.Uint32(h[12:])
		if n > maxOption {
			c.p.logf("faultproxy: option of %d bytes", n)
			return
		}
		if code == optStartTLS || code == optExtended {
			c.p.logf("faultproxy: the client asked for option %d, which the proxy cannot relay", code)
			return
		}
		data := make([]byte, n)
		if readFull(c.client, data) != nil {
			return
		}
		select {
		case c.opts <- option{code: code, noZeroes: noZeroes}:
		case <-c.done:
			return
		}
		if !c.gate() || write(c.server, append(h[:], data...)) != nil {
			return
		}
	}
}

// requests relays requests, the first of whose header's magic is m, until the client
// disconnects.
func (c *conn) requests(m [4]byte) {
	var h [28]byte
	copy(h[:], m[:])
	first := true
	for {
		if !first {
			if !c.gate() || readFull(c.client, h[:]) != nil {
				return
			}
		} else if readFull(c.client, h[4:]) != nil {
			return
		}
		first = false
		if binary.BigEndian.Uint32(h[:]) != magicRequest {
			c.p.logf("faultproxy: bad request magic")
			return
		}
		cmd := binary.BigEndian.Uint16(h[6:])
		cookie := binary.BigEndian.Uint64(h[8:])
		length := binary.BigEndian.Uint32(h[24:])
		var payload []byte
		if cmd == cmdWrite {
			if length > maxPayload {
				return
			}
			payload = make([]byte, length)
			if readFull(c.client, payload) != nil {
				return
			}
		}
		if !c.gate() {
			return
		}
		c.p.mu.Lock()
		failWrite := c.p.failWrite && (cmd == cmdWrite || cmd == cmdWriteZeroes || cmd == cmdTrim)
		failRead := cmd == cmdRead && c.p.readRate > 0 && c.p.rng.Float64() < c.p.readRate
		c.p.mu.Unlock()
		if failWrite || failRead {
			c.p.injected.Add(1)
			if c.replyError(cmd, cookie) != nil {
				return
			}
			continue
		}
		if cmd != cmdDisc {
			c.mu.Lock()
			c.reqs[cookie] = request{read: cmd == cmdRead, length: length}
			c.mu.Unlock()
		}
		if write(c.server, append(h[:], payload...)) != nil || cmd == cmdDisc {
			return
		}
	}
}

// replyError answers a request with EIO: a simple reply, except for a READ once
// structured replies are on (proto.md: the server MUST NOT send a simple reply to one).
func (c *conn) replyError(cmd uint16, cookie uint64) error {
	c.mu.Lock()
	structured := c.structured
	c.mu.Unlock()
	var b []byte
	if cmd == cmdRead && structured {
		msg := "faultproxy: injected read error"
		b = binary.BigEndian.AppendUint32(b, magicStructured)
		b = binary.BigEndian.AppendUint16(b, replyFlagDone)
		b = binary.BigEndian.AppendUint16(b, chunkError)
		b = binary.BigEndian.AppendUint64(b, cookie)
		b = binary.BigEndian.AppendUint32(b, uint32(6+len(msg)))
		b = binary.BigEndian.AppendUint32(b, errEIO)
		b = binary.BigEndian.AppendUint16(b, uint16(len(msg)))
		b = append(b, msg...)
	} else {
		b = binary.BigEndian.AppendUint32(b, magicSimple)
		b = binary.BigEndian.AppendUint32(b, errEIO)
		b = binary.BigEndian.AppendUint64(b, cookie)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return write(c.client, b)
}

// serverToClient relays the greeting and each option's replies, then the replies to
// requests, each whole under wmu so that an injected reply never lands inside one.
func (c *conn) serverToClient() {
	defer close(c.drained)
	defer c.close()
	var greet [18]byte
	if readFull(c.server, greet[:]) != nil || binary.BigEndian.Uint64(greet[:]) != magicNBD || !c.gate() || write(c.client, greet[:]) != nil {
		return
	}
	for {
		var o option
		select {
		case o = <-c.opts:
		case <-c.done:
			return
		}
		if o.code == optExportName {
			n := 10
			if !o.noZeroes {
				n += 124
			}
			b := make([]byte, n)
			if readFull(c.server, b) != nil || !c.gate() || write(c.client, b) != nil {
				return
			}
			c.replies()
			return
		}
		for {
			var h [20]byte
			if readFull(c.server, h[:]) != nil || binary.BigEndian.Uint64(h[:]) != magicOptReply {
				return
			}
			typ, n := binary.BigEndian.Uint32(h[12:]), binary.BigEndian.Uint32(h[16:])
			if n > maxOption {
				return
			}
			data := make([]byte, n)
			if readFull(c.server, data) != nil || !c.gate() || write(c.client, append(h[:], data...)) != nil {
				return
			}
			if typ != repAck && typ&repFlagError == 0 {
				continue // NBD_REP_SERVER, NBD_REP_INFO, ...: more follow
			}
			if typ == repAck && o.code == optStructured {
				c.mu.Lock()
				c.structured = true
				c.mu.Unlock()
			}
			if typ == repAck && o.code == optGo {
				c.replies()
				return
			}
			break
		}
	}
}

// replies relays the server's replies in transmission.
func (c *conn) replies() {
	for {
		var m [4]byte
		if readFull(c.server, m[:]) != nil {
			return
		}
		var b []byte
		switch binary.BigEndian.Uint32(m[:]) {
		case magicSimple:
			var h [16]byte
			copy(h[:], m[:])
			if readFull(c.server, h[4:]) != nil {
				return
			}
			cookie := binary.BigEndian.Uint64(h[8:])
			c.mu.Lock()
			r := c.reqs[cookie]
			delete(c.reqs, cookie)
			c.mu.Unlock()
			b = h[:]
			if r.read && binary.BigEndian.Uint32(h[4:]) == 0 {
				data := make([]byte, r.length)
				if readFull(c.server, data) != nil {
					return
				}
				b = append(b, data...)
			}
		case magicStructured:
			var h [20]byte
			copy(h[:], m[:])
			if readFull(c.server, h[4:]) != nil {
				return
			}
			flags, cookie, n := binary.BigEndian.Uint16(h[4:]), binary.BigEndian.Uint64(h[8:]), binary.BigEndian.Uint32(h[16:])
			if n > maxPayload {
				return
			}
			b = make([]byte, 20+int(n))
			copy(b, h[:])
			if readFull(c.server, b[20:]) != nil {
				return
			}
			if flags&replyFlagDone != 0 {
				c.mu.Lock()
				delete(c.reqs, cookie)
				c.mu.Unlock()
			}
		default:
			c.p.logf("faultproxy: bad reply magic")
			return
		}
		if c.closed() || !c.gate() {
			// The client is gone: drop the reply, and let the server's connection go
			// once nothing is left to answer.
			c.mu.Lock()
			left := len(c.reqs)
			c.mu.Unlock()
			if left == 0 {
				return
			}
			continue
		}
		c.wmu.Lock()
		err := write(c.client, b)
		c.wmu.Unlock()
		if err != nil {
			c.close()
		}
	}
}

func readFull(r io.Reader, b []byte) error {
	_, err := io.ReadFull(r, b)
	return err
}

func write(w io.Writer, b []byte) error {
	_, err := w.Write(b)
	if err != nil {
		return fmt.Errorf("faultproxy: %w", err)
	}
	return nil
}

package nbd

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/elidisk/eli/internal/nbdproto"
)

func oneExportServer(b Backend, mod func(*Export)) *Server {
	e := Export{Name: "", Description: "test disk", Backend: b, MultiConn: true}
	if mod != nil {
		mod(&e)
	}
	return &Server{Exports: []Export{e}}
}

func TestGreetingAndClientFlags(t *testing.T) {
	t.Parallel()
	path := serveUnix(t, oneExportServer(newMem(1<<20), nil))
	tests := []struct {
		name   string
		flags  uint32
		closes bool
	}{
		{"fixed newstyle", nbdproto.FlagCFixedNewstyle, false},
		{"fixed newstyle, no zeroes", nbdproto.FlagCFixedNewstyle | nbdproto.FlagCNoZeroes, false},
		// Plain newstyle allows NBD_OPT_EXPORT_NAME only (TestPlainNewstyle), and an
		// option the server cannot refuse with a reply ends the session.
		{"not fixed newstyle", 0, true},
		{"unknown flag", nbdproto.FlagCFixedNewstyle | 1<<5, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rc := dialRaw(t, path)
			hs, err := rc.greet(tc.flags)
			if err != nil {
				t.Fatal(err)
			}
			if hs != nbdproto.FlagFixedNewstyle|nbdproto.FlagNoZeroes {
				t.Errorf("handshake flags %#x, want fixed newstyle and no zeroes", hs)
			}
			if err := rc.sendOpt(nbdproto.OptList, nil); err != nil && !tc.closes {
				t.Fatal(err)
			}
			if tc.closes {
				rc.expectClosed(t)
				return
			}
			if _, err := rc.readOptReplies(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestOptions drives option haggling with a raw client: every case is a sequence of
// options and the replies each must get; the session must go on after every error reply.
func TestOptions(t *testing.T) {
	t.Parallel()
	mem := newMem(1 << 20)
	srv := &Server{Exports: []Export{
		{Name: "", Description: "default disk", Backend: mem, MultiConn: true},
		{Name: "ro", Backend: newMem(64 << 10), ReadOnly: true, MinBlock: 512, PreferredBlock: 4096, MaxBlock: 1 << 20},
	}}
	path := serveUnix(t, srv)
	big := strings.Repeat("x", maxString+1)
	tests := []struct {
		name string
		opt  uint32
		data []byte
		want []uint32 // reply types, last one final
	}{
		{"unknown option", 999, []byte("junk"), []uint32{nbdproto.RepErrUnsup}},
		{"peek export", nbdproto.OptPeekExport, nil, []uint32{nbdproto.RepErrUnsup}},
		{"set meta context without structured replies", nbdproto.OptSetMetaContext, metaData("", nbdproto.MetaBaseAllocation), []uint32{nbdproto.RepErrInvalid}},
		{"list meta contexts", nbdproto.OptListMetaContext, metaData(""), []uint32{nbdproto.RepMetaContext, nbdproto.RepAck}},
		{"list meta contexts base:", nbdproto.OptListMetaContext, metaData("", "base:"), []uint32{nbdproto.RepMetaContext, nbdproto.RepAck}},
		{"list meta contexts, other namespace", nbdproto.OptListMetaContext, metaData("ro", "qemu:dirty-bitmap:x"), []uint32{nbdproto.RepAck}},
		{"list meta contexts, unknown export", nbdproto.OptListMetaContext, metaData("nope"), []uint32{nbdproto.RepErrUnknown}},
		{"list meta contexts, truncated", nbdproto.OptListMetaContext, metaData("", "base:allocation")[:14], []uint32{nbdproto.RepErrInvalid}},
		{"list meta contexts, trailing bytes", nbdproto.OptListMetaContext, append(metaData(""), 1), []uint32{nbdproto.RepErrInvalid}},
		{"extended headers", nbdproto.OptExtendedHeaders, nil, []uint32{nbdproto.RepAck}},
		{"extended headers with data", nbdproto.OptExtendedHeaders, []byte{1}, []uint32{nbdproto.RepErrInvalid}},
		{"list", nbdproto.OptList, nil, []uint32{nbdproto.RepServer, nbdproto.RepServer, nbdproto.RepAck}},
		{"list with data", nbdproto.OptList, []byte{1}, []uint32{nbdproto.RepErrInvalid}},
		{"structured reply", nbdproto.OptStructuredReply, nil, []uint32{nbdproto.RepAck}},
		{"structured reply with data", nbdproto.OptStructuredReply, []byte{1}, []uint32{nbdproto.RepErrInvalid}},
		{"starttls without TLS configured", nbdproto.OptStartTLS, nil, []uint32{nbdproto.RepErrPolicy}},
		{"info default", nbdproto.OptInfo, goData("", nbdproto.InfoName, nbdproto.InfoDescription), []uint32{nbdproto.RepInfo, nbdproto.RepInfo, nbdproto.RepInfo, nbdproto.RepInfo, nbdproto.RepAck}},
		{"info unknown export", nbdproto.OptInfo, goData("nope"), []uint32{nbdproto.RepErrUnknown}},
		{"info name too long", nbdproto.OptInfo, goData(big), []uint32{nbdproto.RepErrInvalid}},
		{"info short data", nbdproto.OptInfo, []byte{0, 0}, []uint32{nbdproto.RepErrInvalid}},
		{"info name length past data", nbdproto.OptInfo, []byte{0, 0, 1, 0, 0, 0}, []uint32{nbdproto.RepErrInvalid}},
		{"info request count mismatch", nbdproto.OptInfo, append(goData("ro"), 0), []uint32{nbdproto.RepErrInvalid}},
		{"go unknown export", nbdproto.OptGo, goData("nope"), []uint32{nbdproto.RepErrUnknown}},
		{"oversized option data", 999, make([]byte, maxOptionData+1), []uint32{nbdproto.RepErrTooBig}},
		{"oversized info", nbdproto.OptInfo, make([]byte, maxOptionSkip), []uint32{nbdproto.RepErrTooBig}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rc := dialRaw(t, path)
			if _, err := rc.greet(nbdproto.FlagCFixedNewstyle); err != nil {
				t.Fatal(err)
			}
			if err := rc.sendOpt(tc.opt, tc.data); err != nil {
				t.Fatal(err)
			}
			rs, err := rc.readOptReplies()
			if err != nil {
				t.Fatal(err)
			}
			var got []uint32
			for _, r := range rs {
				if r.opt != tc.opt {
					t.Errorf("reply for option %d, want %d", r.opt, tc.opt)
				}
				got = append(got, r.typ)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("reply types %#x, want %#x", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("reply types %#x, want %#x", got, tc.want)
				}
			}
			// The session goes on: a GO must still work.
			if err := rc.sendOpt(nbdproto.OptGo, goData("")); err != nil {
				t.Fatal(err)
			}
			rs, err = rc.readOptReplies()
			if err != nil {
				t.Fatal(err)
			}
			info, err := parseInfos(rs)
			if err != nil {
				t.Fatal(err)
			}
			if info.size != 1<<20 {
				t.Fatalf("size %d after %s", info.size, tc.name)
			}
		})
	}
}

func TestInfoContents(t *testing.T) {
	t.Parallel()
	srv := &Server{Exports: []Export{
		{Name: "", Description: "default disk", Backend: newMem(1 << 20), MultiConn: true},
		{Name: "ro", Description: "read-only", Backend: newMem(64 << 10), ReadOnly: true, MinBlock: 512, PreferredBlock: 4096, MaxBlock: 1 << 20},
		{Name: "plain", Backend: newMem(8192)},
	}}
	path := serveUnix(t, srv)
	const rw = nbdproto.TflagHasFlags | nbdproto.TflagSendFlush | nbdproto.TflagSendFUA | nbdproto.TflagSendTrim | nbdproto.TflagSendWriteZeroes | nbdproto.TflagSendFastZero | nbdproto.TflagSendCache
	tests := []struct {
		name       string
		structured bool
		want       exportInfo
	}{
		{"", false, exportInfo{size: 1 << 20, flags: rw | nbdproto.TflagCanMultiConn, minB: 1, prefB: 4096, maxB: MaxRequest, name: "", description: "default disk"}},
		{"", true, exportInfo{size: 1 << 20, flags: rw | nbdproto.TflagCanMultiConn | nbdproto.TflagSendDF, minB: 1, prefB: 4096, maxB: MaxRequest, name: "", description: "default disk"}},
		{"ro", false, exportInfo{size: 64 << 10, flags: nbdproto.TflagHasFlags | nbdproto.TflagReadOnly | nbdproto.TflagCanMultiConn | nbdproto.TflagSendCache, minB: 512, prefB: 4096, maxB: 1 << 20, name: "ro", description: "read-only"}},
		{"plain", true, exportInfo{size: 8192, flags: rw | nbdproto.TflagSendDF, minB: 1, prefB: 4096, maxB: MaxRequest, name: "plain"}},
	}
	for _, tc := range tests {
		rc := dialRaw(t, path)
		if _, err := rc.greet(nbdproto.FlagCFixedNewstyle); err != nil {
			t.Fatal(err)
		}
		if tc.structured {
			rc.sendOpt(nbdproto.OptStructuredReply, nil)
			if _, err := rc.readOptReplies(); err != nil {
				t.Fatal(err)
			}
		}
		rc.sendOpt(nbdproto.OptInfo, goData(tc.name, nbdproto.InfoName, nbdproto.InfoDescription, nbdproto.InfoBlockSize, 1234))
		rs, err := rc.readOptReplies()
		if err != nil {
			t.Fatal(err)
		}
		got, err := parseInfos(rs)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("export %q structured=%v: info %+v, want %+v", tc.name, tc.structured, got, tc.want)
		}
	}

	// LIST names every export, with its description after the name.
	rc := dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle)
	rc.sendOpt(nbdproto.OptList, nil)
	rs, err := rc.readOptReplies()
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, r := range rs {
		if r.typ == nbdproto.RepServer {
			n := binary.BigEndian.Uint32(r.data)
			listed = append(listed, string(r.data[4:4+n])+"|"+string(r.data[4+n:]))
		}
	}
	if strings.Join(listed, ",") != "|default disk,ro|read-only,plain|" {
		t.Errorf("LIST gave %q", listed)
	}
}

func TestExportName(t *testing.T) {
	t.Parallel()
	srv := &Server{Exports: []Export{{Name: "disk", Backend: newMem(1 << 20)}}}
	path := serveUnix(t, srv)
	for _, noZeroes := range []bool{false, true} {
		rc := dialRaw(t, path)
		f := uint32(nbdproto.FlagCFixedNewstyle)
		if noZeroes {
			f |= nbdproto.FlagCNoZeroes
		}
		rc.greet(f)
		rc.sendOpt(nbdproto.OptExportName, []byte("disk"))
		want := 134
		if noZeroes {
			want = 10
		}
		b := make([]byte, want)
		if _, err := rc.c.Read(b[:0]); err != nil {
			t.Fatal(err)
		}
		if _, err := readFull(rc, b); err != nil {
			t.Fatal(err)
		}
		if size := binary.BigEndian.Uint64(b); size != 1<<20 {
			t.Errorf("size %d", size)
		}
		// Transmission works, without structured replies.
		r := rc.roundTrip(t, nbdproto.CmdRead, 0, 0, 512, nil)
		if r.err != 0 || !r.simple || len(r.data) != 512 {
			t.Errorf("read after EXPORT_NAME: %+v", r)
		}
	}
	// An unknown name can only end the session.
	rc := dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle)
	rc.sendOpt(nbdproto.OptExportName, []byte("nope"))
	rc.expectClosed(t)
}

// TestPlainNewstyle: a client without NBD_FLAG_C_FIXED_NEWSTYLE (flags 0) that sends
// NBD_OPT_EXPORT_NAME is served, with or without the zeroes after the export info.
func TestPlainNewstyle(t *testing.T) {
	t.Parallel()
	srv := &Server{Exports: []Export{{Name: "disk", Backend: newMem(1 << 20)}}}
	path := serveUnix(t, srv)
	for _, flags := range []uint32{0, nbdproto.FlagCNoZeroes} {
		rc := dialRaw(t, path)
		if _, err := rc.greet(flags); err != nil {
			t.Fatal(err)
		}
		rc.sendOpt(nbdproto.OptExportName, []byte("disk"))
		b := make([]byte, 10+nbdproto.ExportNameReplyZeroes)
		if flags != 0 {
			b = b[:10]
		}
		if _, err := readFull(rc, b); err != nil {
			t.Fatalf("flags %#x: %v", flags, err)
		}
		if size := binary.BigEndian.Uint64(b); size != 1<<20 {
			t.Fatalf("flags %#x: size %d", flags, size)
		}
		data := pattern(4096, 3)
		if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, 8192, 4096, data); r.err != 0 {
			t.Fatalf("flags %#x: write: %+v", flags, r)
		}
		r := rc.roundTrip(t, nbdproto.CmdRead, 0, 8192, 4096, nil)
		if r.err != 0 || !r.simple {
			t.Fatalf("flags %#x: read: %+v", flags, r)
		}
		mustEqual(t, "read back", r.data, data)
	}
}

// metaData is the option data of NBD_OPT_{LIST,SET}_META_CONTEXT.
func metaData(export string, queries ...string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	b = append(b, export...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(queries)))
	for _, q := range queries {
		b = binary.BigEndian.AppendUint32(b, uint32(len(q)))
		b = append(b, q...)
	}
	return b
}

func readFull(rc *rawClient, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		k, err := rc.c.Read(b[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// TestHandshakeViolations: each ends the connection without a reply that pretends success.
func TestHandshakeViolations(t *testing.T) {
	t.Parallel()
	path := serveUnix(t, oneExportServer(newMem(1<<20), nil))
	badMagic := optBytes(nbdproto.OptList, nil)
	badMagic[0] ^= 0xff
	tests := []struct {
		name string
		send []byte
	}{
		{"bad option magic", badMagic},
		{"option data beyond what the server will skip", optBytes(999, make([]byte, maxOptionSkip+1))[:16]},
		{"export name too long", optBytes(nbdproto.OptExportName, make([]byte, maxString+1))},
		{"export name past the data limit", optBytes(nbdproto.OptExportName, make([]byte, maxOptionData+1))},
		{"abort", optBytes(nbdproto.OptAbort, nil)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rc := dialRaw(t, path)
			rc.greet(nbdproto.FlagCFixedNewstyle)
			if err := rc.write(tc.send); err != nil {
				t.Fatal(err)
			}
			if tc.name == "abort" {
				r, err := rc.readOptReply()
				if err != nil || r.typ != nbdproto.RepAck {
					t.Fatalf("abort reply %+v %v", r, err)
				}
			}
			rc.expectClosed(t)
		})
	}
}

func TestTooManyOptions(t *testing.T) {
	t.Parallel()
	path := serveUnix(t, oneExportServer(newMem(4096), nil))
	rc := dialRaw(t, path)
	rc.greet(nbdproto.FlagCFixedNewstyle)
	for i := 0; i < maxOptions; i++ {
		rc.sendOpt(999, nil)
		if r, err := rc.readOptReply(); err != nil || r.typ != nbdproto.RepErrUnsup {
			t.Fatalf("option %d: %+v %v", i, r, err)
		}
	}
	rc.sendOpt(999, nil)
	rc.expectClosed(t)
}

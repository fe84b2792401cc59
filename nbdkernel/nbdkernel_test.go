package nbdkernel

import (
	"os"
	"testing"

	"github.com/mdlayher/netlink"
)

func TestParseDevice(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"/dev/nbd0", 0, true},
		{"/dev/nbd15", 15, true},
		{"/dev/nbd", 0, false},
		{"/dev/sda", 0, false},
		{"nbd0", 0, false},
		{"/dev/nbd0p1", 0, false},
		{"/dev/nbd99999999999", 0, false},
	} {
		got, err := ParseDevice(tc.in)
		if (err == nil) != tc.ok || (tc.ok && got != tc.want) {
			t.Errorf("ParseDevice(%q) = %d, %v; want %d, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// TestConnectAttrs decodes the NBD_CMD_CONNECT payload the way the kernel's
// nbd_genl_connect does and checks every attribute it relies on.
func TestConnectAttrs(t *testing.T) {
	t.Parallel()
	var socks []*os.File
	for i := 0; i < 3; i++ {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		defer w.Close()
		socks = append(socks, r)
	}
	cfg := Config{Index: 7, Size: 1 << 30, BlockSize: 4096, ServerFlags: 0x16d, TimeoutSeconds: 30, Sockets: socks}
	b, err := connectAttrs(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[uint16]bool{}
	var fds []uint32
	for ad.Next() {
		seen[ad.Type()] = true
		switch ad.Type() {
		case attrIndex:
			if v := ad.Uint32(); v != 7 {
				t.Errorf("index = %d", v)
			}
		case attrSizeBytes:
			if v := ad.Uint64(); v != 1<<30 {
				t.Errorf("size = %d", v)
			}
		case attrBlockSizeBytes:
			if v := ad.Uint64(); v != 4096 {
				t.Errorf("block size = %d", v)
			}
		case attrServerFlags:
			if v := ad.Uint64(); v != 0x16d {
				t.Errorf("server flags = %#x", v)
			}
		case attrClientFlags:
			if v := ad.Uint64(); v != clientFlagDestroyOnDisconnect {
				t.Errorf("client flags = %#x", v)
			}
		case attrTimeout:
			if v := ad.Uint64(); v != 30 {
				t.Errorf("timeout = %d", v)
			}
		case attrSockets:
			ad.Nested(func(nad *netlink.AttributeDecoder) error {
				for nad.Next() {
					if nad.Type() != sockItem {
						t.Errorf("socket list holds attribute %d, want NBD_SOCK_ITEM", nad.Type())
					}
					nad.Nested(func(iad *netlink.AttributeDecoder) error {
						for iad.Next() {
							if iad.Type() == sockFD {
								fds = append(fds, iad.Uint32())
							}
						}
						return nil
					})
				}
				return nil
			})
		default:
			t.Errorf("unexpected attribute %d", ad.Type())
		}
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	for _, a := range []uint16{attrIndex, attrSizeBytes, attrBlockSizeBytes, attrServerFlags, attrSockets, attrTimeout} {
		if !seen[a] {
			t.Errorf("attribute %d missing", a)
		}
	}
	if len(fds) != len(socks) {
		t.Fatalf("got %d socket fds, want %d", len(fds), len(socks))
	}
	for i, f := range socks {
		if fds[i] != uint32(f.Fd()) {
			t.Errorf("socket %d: fd %d, want %d", i, fds[i], f.Fd())
		}
	}
}

func TestConnectAttrsAnyDevice(t *testing.T) {
	t.Parallel()
	r, w, _ := os.Pipe()
	defer r.Close()
	defer w.Close()
	b, err := connectAttrs(Config{Index: -1, Size: 8192, BlockSize: 512, Sockets: []*os.File{r}})
	if err != nil {
		t.Fatal(err)
	}
	ad, _ := netlink.NewAttributeDecoder(b)
	for ad.Next() {
		if ad.Type() == attrIndex {
			t.Fatal("index sent although the kernel should pick the device")
		}
	}
}

func TestConnectAttrsRejects(t *testing.T) {
	t.Parallel()
	r, w, _ := os.Pipe()
	defer r.Close()
	defer w.Close()
	for name, c := range map[string]Config{
		"no sockets":     {Index: 0, Size: 4096, BlockSize: 4096},
		"odd block size": {Index: 0, Size: 4096, BlockSize: 1000, Sockets: []*os.File{r}},
		"size unaligned": {Index: 0, Size: 4097, BlockSize: 4096, Sockets: []*os.File{r}},
		"zero size":      {Index: 0, Size: 0, BlockSize: 4096, Sockets: []*os.File{r}},
	} {
		if _, err := connectAttrs(c); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := disconnectAttrs(-1); err == nil {
		t.Error("disconnect without index accepted")
	}
	b, err := disconnectAttrs(3)
	if err != nil {
		t.Fatal(err)
	}
	ad, _ := netlink.NewAttributeDecoder(b)
	if !ad.Next() || ad.Type() != attrIndex || ad.Uint32() != 3 {
		t.Error("disconnect payload does not carry the index")
	}
}

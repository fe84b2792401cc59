package nbd

import (
	"bytes"
	"sync"
	"testing"

	"github.com/elidisk/eli/internal/nbdproto"
)

// keepingMem is a Keeper that holds every WRITE's buffer until the test hands it back,
// and scribbles over it meanwhile, as a backend sealing in place would.
type keepingMem struct {
	*memBackend
	mu   sync.Mutex
	held []keptBuf
}

type keptBuf struct {
	p, copy []byte // the buffer, and what it held after the backend changed it
	done    func()
}

func (k *keepingMem) WriteKeep(p []byte, off int64, f Flags, done func()) error {
	if err := k.WriteAt(p, off, f); err != nil {
		done()
		return err
	}
	for i := range p {
		p[i] ^= 0x5a
	}
	k.mu.Lock()
	k.held = append(k.held, keptBuf{p, bytes.Clone(p), done})
	k.mu.Unlock()
	return nil
}

// TestKeeperOwnsBuffers: a backend that implements Keeper gets WRITE payloads through
// WriteKeep and may keep and change them: while it holds them, the server reads no
// other payload into them, and the data it stored is what the client sent. Handed back,
// they serve again.
func TestKeeperOwnsBuffers(t *testing.T) {
	t.Parallel()
	k := &keepingMem{memBackend: newMem(8 << 20)}
	path := serveUnix(t, oneExportServer(k, nil))
	rc, _ := mustConnect(t, path, true)
	const size = 64 << 10
	for round := range 3 {
		for i := range 16 {
			data := pattern(size, byte(16*round+i))
			if r := rc.roundTrip(t, nbdproto.CmdWrite, 0, uint64(i*size), size, data); r.err != 0 {
				t.Fatalf("write: error %d", r.err)
			}
			r := rc.roundTrip(t, nbdproto.CmdRead, 0, uint64(i*size), size, nil)
			mustEqual(t, "read back", r.data, data)
		}
		k.mu.Lock()
		held := k.held
		k.held = nil
		k.mu.Unlock()
		if len(held) != 16 {
			t.Fatalf("round %d: %d buffers kept, want 16", round, len(held))
		}
		for x, h := range held {
			if !bytes.Equal(h.p, h.copy) {
				t.Fatalf("round %d: kept buffer %d changed while the backend held it", round, x)
			}
			for y := range x {
				if &held[y].p[0] == &h.p[0] {
					t.Fatalf("round %d: buffers %d and %d are one", round, y, x)
				}
			}
		}
		for _, h := range held {
			h.done()
		}
	}
}

package integration

import (
	"testing"
	"time"
)

// TestAutoDetach: attach -d serves until its last client disconnects, after at least
// one connected (geli attach -d), then detaches by itself and frees the name.
func TestAutoDetach(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true)
	img := e.create(volume{name: "d.img", size: "16M"})
	uri := e.Attach(img, "-d")
	time.Sleep(300 * time.Millisecond)
	if l := listed(e); len(l) != 1 || l[0].State != "serving" {
		t.Fatalf("attach -d before any client: %+v, want it serving", l)
	}
	c := dialURI(t, uri)
	if err := c.WriteAt(make([]byte, 4096), 0, true); err != nil {
		t.Fatal(err)
	}
	c.Close()
	for deadline := time.Now().Add(time.Minute); len(listed(e)) != 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) { // a hang guard
			t.Fatalf("attach -d still attached after its only client left: %+v", listed(e))
		}
	}
	e.Attach(img) // the name and the volume are free
	e.detach("d.img")
}

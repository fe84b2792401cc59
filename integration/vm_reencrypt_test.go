package integration

import (
	_ "embed"
	"strconv"
	"strings"
	"testing"
	"time"
)

//go:embed vm/reencrypt.sh
var reencryptGuestScript []byte

// TestVMReencrypt boots Debian's 6.1 kernel under qemu (TCG) and re-encrypts an eli
// volume online while ext4 is mounted on its /dev/nbd0 and a writer fsyncs all along:
// eli reencrypt hands the key to the server and returns (--detach), status and list
// show the re-encryption, a second reencrypt is refused, the server is killed with -9
// halfway and a new attach re-plugs the device and resumes it by itself; at the end the
// header holds no previous key, every file is intact (from the cache and from eli),
// the kernel logged no I/O error, and fsck finds the filesystem clean. The guest
// (vm/reencrypt.sh) reports; this test judges.
func TestVMReencrypt(t *testing.T) {
	g := newGuest(t, reencryptGuestScript, "")
	// A hang guard, not a timing assertion (the guest has its own watchdog).
	console, res := g.boot(t, "", 10*time.Minute)
	get := func(key string) string { return strings.Join(res[key], " ") }
	want := func(key, v string) {
		t.Helper()
		if got := get(key); got != v {
			t.Errorf("%s = %q, want %q", key, got, v)
		}
	}
	if _, ok := res["watchdog"]; ok {
		t.Errorf("the guest's watchdog fired: a step hung")
	}
	for _, k := range []string{"init_rc", "attach_rc", "mkfs_rc", "mount_rc", "reencrypt_rc", "reattach_rc",
		"writer_rc", "umount_rc", "detach_rc", "attach_after_rc", "fsck_rc", "final_detach_rc", "kernel_errors"} {
		want(k, "0")
	}
	if m := get("reencrypt_msg"); !strings.Contains(m, "runs in its server") {
		t.Errorf("eli reencrypt --detach said %q", m)
	}
	want("state_running", "running")
	want("list_says", "re-encrypting")
	if get("second_rc") != "1" || !strings.Contains(get("second_msg"), "under way") {
		t.Errorf("a second reencrypt while one runs: rc %s, %q; want a refusal", get("second_rc"), get("second_msg"))
	}
	want("killed_halfway", "yes")
	if s := get("resumed_state"); s != "running" && s != "done" {
		t.Errorf("after the re-attach the re-encryption is %q, want it resumed", s)
	}
	want("final_state", "done")
	want("status_done", "1")
	want("writer_at", "255")
	if n, err := strconv.Atoi(get("dump_epoch")); err != nil || n != 1 {
		t.Errorf("key epoch after the re-encryption: %q", get("dump_epoch"))
	}
	want("dump_reencryption", "none")
	for _, k := range []string{"writer_cmp_cached", "sums", "writer_cmp", "sums_after", "writer_cmp_after"} {
		want(k, "ok")
	}
	if t.Failed() {
		t.Logf("console:\n%s", tail(console, 8000))
	}
}

// Package integration tests eli from the outside, the way its users run it: the real `eli`
// binary (built once per run), driven only through its command line, and real NBD clients
// (nbdinfo, nbdcopy, nbdfuse with a loop device and ext4, qemu-img, qemu-io, fio,
// python3-libnbd). It holds no library code; everything is in the _test.go files and in
// the ddbench script, which is also runnable by hand (`integration/ddbench -h`).
// Where a check needs an oracle, it is a server we did not write: TestDifferential holds
// eli to nbdkit's file plugin, request by request (testdata/nbddiff.py).
//
// Run it with `go test ./integration/` (as root: loop devices and mounts). Without a tool
// a test skips and says what to install; under ELI_REQUIRE_TOOLS=1 (scripts/test) it fails
// instead. ELI_BIN=PATH tests a given eli binary instead of building this checkout;
// ELI_KILL_SEED=N repeats a run of the kill -9 test.
//
// Providers that hold real amounts of data live in /dev/shm; sockets live in short state
// directories under $TMPDIR (unix socket paths are limited to 107 bytes). Every directory
// the tests make outside t.TempDir carries the test process's pid, so that the next run
// can remove the mounts, loop devices and servers a killed run left behind.
package integration

// Package integration tests eli from the outside, the way its users run it: the real `eli`
// binary (built once per run), driven only through its command line, and real NBD clients
// (nbdinfo, nbdcopy, nbdfuse with a loop device and ext4, qemu-img, qemu-io, fio,
// python3-libnbd). It holds no library code; everything is in the _test.go files and in
// the ddbench script, which is also runnable by hand (`integration/ddbench -h`).
//
// The tests need root (loop devices, mount) and the tools scripts/test installs; run by
// hand without them they skip and say what is missing, under ELI_REQUIRE_TOOLS=1 they fail.
package integration

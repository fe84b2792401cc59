#!/bin/sh
# /init of TestVMHoldDevice's guest (integration/vmhold_test.go). ext4 on kernel NBD
# devices served by eli, whose servers are stopped (SIGSTOP) for a hold longer than the
# kernel's 30 s timeouts while files are written, then continued: the kernel sees no reply
# and no read of its sockets for the whole hold, as it will while eli is suspended. The
# devices:
#
#   main     connected by nbdhold, which raises the request timeout and the sockets'
#            send timeout before the hold (nbdkernel.Device.SetTimeout) and restores them
#            after it.
#   nlonly   the same, but the raise changes only the request timeout (netlink,
#            nbdkernel.SetRequestTimeout): the sockets keep their 30 s send timeout.
#   control  'eli attach --device', nothing raised.
#
# It prints "ELI-RESULT key value..." lines and decides nothing itself.
. /lib/eli-prelude.sh
hold=180
for a in $(cat /proc/cmdline); do
	case $a in eli.hold=*) hold=${a#eli.hold=} ;; esac
done
r hold "$hold"
watchdog $((hold + 360))
load_modules

echo "vm test passphrase" >/tmp/pass
eli() { /bin/eli "$@"; }
pid() { grep -o '"pid": *[0-9]*' "$ELI_STATE_DIR/$1.json" | grep -o '[0-9]*$'; }
# status NAME WORD: nbdhold's last status line for NAME that starts with WORD (waits 20 s).
status() {
	n=0
	while ! grep -q "^$2" "/tmp/$1.status" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.2; n=$((n + 1)); done
	grep "^$2" "/tmp/$1.status" | tail -1
}
devs="main nlonly control"
dev_main=/dev/nbd0
dev_nlonly=/dev/nbd1
dev_control=/dev/nbd2
dev() { eval "echo \$dev_$1"; }
holder() { eval "echo \$holder_$1"; }

for d in $devs; do
	eli init --passphrase-file /tmp/pass --kdf-time 1 --kdf-memory 8 --kdf-threads 1 --size 96M "/tmp/$d.img" >"/tmp/$d.init" 2>&1 || { r init_failed "$d"; cat "/tmp/$d.init"; exit 0; }
done
for d in main nlonly; do
	eli attach --passphrase-file /tmp/pass --name "$d" "/tmp/$d.img" >"/tmp/$d.attach" 2>&1 || { r attach_failed "$d"; cat "/tmp/$d.attach"; exit 0; }
	flag=
	[ $d = nlonly ] && flag=-netlink-only
	/bin/nbdhold -socket "$ELI_STATE_DIR/$d.sock" -device "$(dev $d)" -connections 2 -status "/tmp/$d.status" $flag 2>"/tmp/$d.nbdhold" &
	eval "holder_$d=$!"
	r "${d}_connected" $(status $d connected)
	[ -n "$(status $d connected)" ] || { cat "/tmp/$d.nbdhold"; exit 0; }
done
eli attach --passphrase-file /tmp/pass --name control --device "$dev_control" --connections 2 /tmp/control.img >/tmp/control.attach 2>&1 || { r attach_failed control; cat /tmp/control.attach; exit 0; }
r control_connected "$(cat /sys/block/nbd2/queue/io_timeout)"

dd if=/dev/urandom of=/tmp/src bs=1M count=16 2>/dev/null
head -c 3000 /tmp/src >/tmp/small
for d in $devs; do
	# Without lazy init: no background writes of inode tables after the mount.
	mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$(dev $d)" >/dev/null 2>&1 || r mkfs_failed "$d"
	mkdir -p "/mnt/$d"
	mount -t ext4 "$(dev $d)" "/mnt/$d" || r mount_failed "$d"
	cp /tmp/src "/mnt/$d/before"
done
sync
for d in main nlonly; do
	kill -USR1 "$(holder $d)"
	r "${d}_raised" $(status $d raised)
done
# A request keeps the timeout it started with: each server answers until its device has
# had nothing in flight once since the raise (what a suspend's drain does), then stops.
for d in $devs; do
	nb=$(dev $d)
	n=0
	while [ "$(cat /sys/block/${nb#/dev/}/inflight | tr -d ' ')" != 00 ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
	kill -STOP "$(pid $d)"
	r "${d}_drained_in_ms" $((n * 100))
done
dmesg -c >/dev/null
held_at=$(date +%s)
r held "$(cut -d' ' -f1 /proc/uptime)"

# Writes during the hold: a buffered file then fsync, O_DIRECT pieces of 1 MiB (each one
# request larger than what a socket's buffer takes), and small files, each fsynced.
for d in $devs; do
	(dd if=/tmp/src of="/mnt/$d/buffered" bs=1M conv=fsync 2>/dev/null; echo $? >"/tmp/$d.rc1") &
	(dd if=/tmp/src of="/mnt/$d/direct" bs=1M oflag=direct conv=fsync 2>/dev/null; echo $? >"/tmp/$d.rc2") &
	(rc=0; for k in 1 2 3 4 5 6 7 8; do dd if=/tmp/small of="/mnt/$d/small$k" conv=fsync 2>/dev/null || rc=1; done; echo $rc >"/tmp/$d.rc3") &
done
sleep "$hold"
r held_for $(($(date +%s) - held_at))
for d in $devs; do
	n=0
	for k in 1 2 3; do [ -e "/tmp/$d.rc$k" ] && n=$((n + 1)); done
	r "${d}_finished_in_hold" $n
done
dmesg >/tmp/dmesg.hold
for d in $devs; do
	kill -CONT "$(pid $d)"
done

# main's writers end (150 s is a hang guard); the others' may wait on their dead device.
n=0
while [ $n -lt 750 ]; do
	left=0
	for k in 1 2 3; do [ -e "/tmp/main.rc$k" ] || left=$((left + 1)); done
	[ $left -eq 0 ] && break
	sleep 0.2
	n=$((n + 1))
done
r main_writers_after_hold_s $((n / 5))
for d in main nlonly; do
	kill -USR2 "$(holder $d)"
	r "${d}_restored" $(status $d restored)
done
dmesg >/tmp/dmesg.all
for d in $devs; do
	nb=$(dev $d)
	nb=${nb#/dev/}
	r "${d}_rc" "$(cat /tmp/$d.rc1 2>/dev/null || echo none)" "$(cat /tmp/$d.rc2 2>/dev/null || echo none)" "$(cat /tmp/$d.rc3 2>/dev/null || echo none)"
	r "${d}_io_errors" "$(grep -c -e "I/O error.*$nb" -e "error.*device $nb" /tmp/dmesg.all)"
	r "${d}_timed_out" "$(grep -c "$nb: Connection timed out" /tmp/dmesg.all)"
	r "${d}_send_failed" "$(grep -c -e "$nb: Send control failed" -e "$nb: Send data failed" /tmp/dmesg.all)"
	r "${d}_dead" "$(grep -c "$nb: Dead connection" /tmp/dmesg.all)"
done
r hung_task_warnings "$(grep -c 'blocked for more than' /tmp/dmesg.all)"
# The other two devices go: what still waits on them fails now instead of waiting for
# connections that will not come back.
kill "$(holder nlonly)"
eli detach --force control >/dev/null 2>&1

# main's files, read back from eli: what was written during the hold is there.
sync -f /mnt/main/before
echo 3 >/proc/sys/vm/drop_caches
ok=0
for f in before buffered direct; do cmp -s /tmp/src "/mnt/main/$f" && ok=$((ok + 1)); done
for k in 1 2 3 4 5 6 7 8; do cmp -s /tmp/small "/mnt/main/small$k" && ok=$((ok + 1)); done
r main_files_ok $ok
umount /mnt/main
r main_umount_rc $?
e2fsck -f -n "$dev_main" >/tmp/fsck.out 2>&1
r main_fsck_rc $?
# The restored timeouts serve a new mount as before.
mount -t ext4 "$dev_main" /mnt/main
dd if=/tmp/src of=/mnt/main/after bs=1M oflag=direct conv=fsync 2>/dev/null
r main_after_rc $?
umount /mnt/main
kill "$(holder main)"

echo "---- dmesg (nbd, EXT4, hung tasks)"
grep -e nbd -e EXT4 -e 'blocked for' /tmp/dmesg.all | head -40
exit 0

#!/bin/sh
# /init of TestVMSuspend's guest (integration/vmsuspend_test.go): ext4 on kernel NBD
# devices served by 'eli attach --device', held for longer than the kernel's timeouts
# while files are written:
#
#   main     'eli suspend' (its keys wiped, the device's timeouts raised, its requests
#            held) for the hold, then 'eli resume'
#   control  its server stopped (SIGSTOP) for the same hold, nothing raised: the hold
#            fails the file system's I/O when the timeouts stay as they are
#
# It prints "ELI-RESULT key value..." lines and decides nothing itself.
. /lib/eli-prelude.sh
hold=180
for a in $(cat /proc/cmdline); do
	case $a in eli.hold=*) hold=${a#eli.hold=} ;; esac
done
r hold "$hold"
watchdog $((hold + 420))
load_modules

echo "vm test passphrase" >/tmp/pass
eli() { /bin/eli "$@"; }
pid() { grep -o '"pid": *[0-9]*' "$ELI_STATE_DIR/$1.json" | grep -o '[0-9]*$'; }
# field NAME KEY: a field of 'eli status --json NAME' (whatever its exit).
field() { eli status --json "$1" 2>/dev/null | grep "\"$2\":" | head -1 | sed 's/^[^:]*: *//; s/[",]//g'; }
io_timeout() { cat "/sys/block/$1/queue/io_timeout"; }
devs="main control"
dev_main=/dev/nbd0
dev_control=/dev/nbd1
dev() { eval "echo \$dev_$1"; }

for d in $devs; do
	eli init --passphrase-file /tmp/pass --kdf-time 1 --kdf-memory 8 --kdf-threads 1 --size 96M "/tmp/$d.img" >"/tmp/$d.init" 2>&1 || { r init_failed "$d"; cat "/tmp/$d.init"; exit 0; }
	eli attach --passphrase-file /tmp/pass --name "$d" --device "$(dev $d)" "/tmp/$d.img" >"/tmp/$d.attach" 2>&1 || { r attach_failed "$d"; cat "/tmp/$d.attach"; exit 0; }
done
r main_connected "$(io_timeout nbd0)"

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

start=$(cut -d' ' -f1 /proc/uptime)
eli suspend main >/tmp/suspend.out 2>&1
r main_suspend_rc $?
cat /tmp/suspend.out
r main_suspend_took "$start" "$(cut -d' ' -f1 /proc/uptime)"
r main_raised "$(io_timeout nbd0)"
r main_state "$(field main state)"
kill -STOP "$(pid control)"
dmesg -c >/dev/null
held_at=$(date +%s)

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
r main_held_state "$(field main state)" "$(field main held)"
dmesg >/tmp/dmesg.hold

# A wrong passphrase changes nothing; the right one resumes.
echo "not the passphrase" >/tmp/wrong
eli resume --passphrase-file /tmp/wrong main >/tmp/wrong.out 2>&1
r main_wrong_rc $?
r main_wrong_state "$(field main state)"
eli resume --passphrase-file /tmp/pass main >/tmp/resume.out 2>&1
r main_resume_rc $?
cat /tmp/resume.out
kill -CONT "$(pid control)"

# main's writers end (150 s is a hang guard); control's may wait on its dead device.
n=0
while [ $n -lt 750 ]; do
	left=0
	for k in 1 2 3; do [ -e "/tmp/main.rc$k" ] || left=$((left + 1)); done
	[ $left -eq 0 ] && break
	sleep 0.2
	n=$((n + 1))
done
r main_writers_after_resume_s $((n / 5))
r main_restored "$(io_timeout nbd0)"
r main_state_after "$(field main state)"
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
# The control goes: what still waits on it fails now.
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
echo "---- main's server log"
tail -30 "$ELI_STATE_DIR/main.log" 2>/dev/null
eli detach main >/tmp/detach.out 2>&1
r main_detach_rc $?

echo "---- dmesg (nbd, EXT4, hung tasks)"
grep -e nbd -e EXT4 -e 'blocked for' /tmp/dmesg.all | head -40
exit 0

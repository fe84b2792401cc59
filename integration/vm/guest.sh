#!/bin/sh
# /init of the VM test's guest. It drives eli and /dev/nbd0 and prints one line per
# finding, "ELI-RESULT key value...", which integration/vm_test.go parses and checks.
# It never decides pass or fail itself: it reports what it saw.
. /lib/eli-prelude.sh
# The script takes about a minute; 420 s leaves room for a host whose other tenants starve
# the vCPUs (a CI run in a slow stretch once failed here with the guest reporting soft
# lockups, which is a vCPU not run for 20 s).
watchdog 420
load_modules

SS=4096
P=/tmp/disk.img
echo "vm test passphrase" >/tmp/pass
eli() { /bin/eli "$@"; }
field() { grep -o "\"$1\": *[0-9]*" "$ELI_STATE_DIR/vol.json" | grep -o '[0-9]*$'; }
sums() { (cd /mnt && sha256sum a b direct) >"$1"; }
dropcaches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
qattr() { cat "/sys/block/nbd0/queue/$1" 2>/dev/null || echo none; }

eli init --passphrase-file /tmp/pass --kdf-time 1 --kdf-memory 8 --kdf-threads 1 --sector-size $SS --size 192M $P >/tmp/init.out 2>&1
rc=$?
r init_rc $rc
[ $rc -eq 0 ] || { cat /tmp/init.out; exit 0; }
eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 $P >/tmp/attach.out 2>&1
rc=$?
r attach_rc $rc
[ $rc -eq 0 ] || { cat /tmp/attach.out; exit 0; }

# Which kernel threads run nbd0's receive work, printed when the kernel times a request out:
# one per connection should wait in a socket read. Linux 6.1 runs that work on the
# device's workqueue, whose rescuer (a thread named nbd0-recv) takes every pending item
# at once and runs them one after another when creating a worker is slow; the work ends
# only with its socket, so the others then never run (TestVMReceiveStarvation).
recvthreads() {
	for d in /proc/[0-9]*; do
		[ -s "$d/cmdline" ] && continue
		c=$(cat "$d/comm" 2>/dev/null)
		case "$c" in
		*nbd0-recv*) echo "ELI-DIAG receive thread ${d#/proc/} $c $(cat "$d/wchan" 2>/dev/null)" ;;
		esac
	done
}

# A request the kernel times out ("Connection timed out") was either slow in the server or
# lost in the kernel: the server's log tells which, since its line for each closed
# connection gives the slowest reply. The crash sections below time requests out on
# purpose, so the watch ends there.
( while [ ! -e /tmp/crashing ]; do
	if dmesg | grep -q 'timed out'; then
		recvthreads
		sleep 5
		echo ELI-SERVER-LOG-BEGIN
		cat "$ELI_STATE_DIR/vol.log"
		echo ELI-SERVER-LOG-END
		break
	fi
	sleep 1
done ) &

# What the kernel was told.
r eli_size "$(field size)"
r dev_size "$(( $(cat /sys/block/nbd0/size) * 512 ))"
r sector_size $SS
r logical_block_size "$(qattr logical_block_size)"
r physical_block_size "$(qattr physical_block_size)"
r max_sectors_kb "$(qattr max_sectors_kb)"
r max_hw_sectors_kb "$(qattr max_hw_sectors_kb)"
r write_zeroes_max_bytes "$(qattr write_zeroes_max_bytes)"
r discard_max_bytes "$(qattr discard_max_bytes)"
r backend "$(cat /sys/block/nbd0/backend 2>/dev/null || echo none)"

# O_DIRECT on the raw device, before there is a filesystem.
dd if=/dev/urandom of=/tmp/raw bs=64k count=16 2>/dev/null
dd if=/tmp/raw of=/dev/nbd0 bs=64k seek=100 oflag=direct 2>/dev/null
r raw_direct_write_rc $?
dd if=/dev/nbd0 of=/tmp/raw.back bs=64k skip=100 count=16 iflag=direct 2>/dev/null
cmp -s /tmp/raw /tmp/raw.back && r raw_direct_cmp ok || r raw_direct_cmp differ

mkfs.ext4 -q -F -E nodiscard /dev/nbd0 >/tmp/mkfs.out 2>&1
r mkfs_rc $?
mount -t ext4 /dev/nbd0 /mnt
rc=$?
r mount_rc $rc
# On a failure, what the server and the kernel said: the console is all the test keeps.
[ $rc -eq 0 ] || { cat /tmp/attach.out "$ELI_STATE_DIR/vol.log"; dmesg | tail -20; exit 0; }
dd if=/dev/urandom of=/mnt/a bs=1M count=24 conv=fsync 2>/dev/null
r write_a_rc $?
dd if=/dev/urandom of=/mnt/b bs=4k count=37 conv=fsync 2>/dev/null
r write_b_rc $?
dd if=/tmp/raw of=/mnt/direct bs=64k oflag=direct conv=fsync 2>/dev/null
r direct_write_rc $?
sync
dropcaches
dd if=/mnt/direct of=/tmp/direct.back bs=64k iflag=direct 2>/dev/null
cmp -s /tmp/raw /tmp/direct.back && r fs_direct_cmp ok || r fs_direct_cmp differ
sums /tmp/sums

# Detach while mounted: refused, and the server keeps serving.
eli detach vol >/tmp/detach1.out 2>&1
r detach_mounted_rc $?
r detach_mounted_msg "$(head -1 /tmp/detach1.out)"
[ -e "$ELI_STATE_DIR/vol.json" ] && r detach_mounted_server alive || r detach_mounted_server gone
dropcaches
(cd /mnt && sha256sum -c /tmp/sums >/dev/null 2>&1) && r sums_after_refusal ok || r sums_after_refusal bad
umount /mnt
r umount_rc $?

# Held open by a process (not mounted): refused too.
sleep 600 </dev/nbd0 &
holder=$!
sleep 1
eli detach vol >/tmp/detach2.out 2>&1
r detach_held_rc $?
r detach_held_msg "$(head -1 /tmp/detach2.out)"
kill $holder; wait $holder 2>/dev/null

dmesg -c >/dev/null
eli detach vol >/tmp/detach3.out 2>&1
r detach_rc $?
[ -e /sys/block/nbd0/pid ] && r detach_dev bound || r detach_dev unbound
r detach_kernel_errors "$(dmesg | grep -c -i -e 'disconnect failed' -e 'invalid argument')"

# Re-attach: the files are intact.
eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 $P >/tmp/attach2.out 2>&1
r reattach_rc $?
mount -t ext4 /dev/nbd0 /mnt
r remount_rc $?
(cd /mnt && sha256sum -c /tmp/sums >/dev/null 2>&1) && r sums_after_reattach ok || r sums_after_reattach bad

# fstrim reaches eli as TRIM: the provider's allocated blocks shrink.
rm /mnt/a
sync
before=$(stat -c %b $P)
fstrim /mnt >/tmp/fstrim.out 2>&1
r fstrim_rc $?
sync
after=$(stat -c %b $P)
r trim_blocks "$before" "$after"

touch /tmp/crashing
# Crash: kill -9 the server while a file is written (each piece fsynced), then attach
# again within the dead-connection timeout. Every write(2) the writer finishes is
# durable, so the file must end up equal to its source.
dd if=/dev/urandom of=/tmp/src bs=64k count=96 2>/dev/null
dmesg -c >/dev/null
(
	i=0
	while [ $i -lt 96 ]; do
		dd if=/tmp/src of=/mnt/log bs=64k skip=$i seek=$i count=1 conv=notrunc,fsync 2>/dev/null || { echo "fail $i" >/tmp/writer.err; exit 1; }
		echo $i >/tmp/writer.at
		i=$((i + 1))
	done
) &
writer=$!
n=0
while [ "$(cat /tmp/writer.at 2>/dev/null || echo 0)" -lt 16 ] && [ $n -lt 600 ]; do sleep 0.2; n=$((n + 1)); done
pid=$(field pid)
kill -9 "$pid"
r killed_at "$(cat /tmp/writer.at)"
sleep 1
# Pieces up to this one had their fsync completed by the old server.
r replug_at "$(cat /tmp/writer.at)"
eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 $P >/tmp/attach3.out 2>&1
rc=$?
r crash_reattach_rc $rc
[ $rc -eq 0 ] || cat /tmp/attach3.out
wait $writer
r writer_rc $?
r writer_at "$(cat /tmp/writer.at)"
cmp -s /tmp/src /mnt/log && r crash_cmp_cached ok || r crash_cmp_cached differ
umount /mnt
mount -t ext4 /dev/nbd0 /mnt
cmp -s /tmp/src /mnt/log && r crash_cmp ok || r crash_cmp differ
# Which 64 KiB pieces differ, if any.
r crash_diff_pieces $(cmp -l /tmp/src /mnt/log 2>/dev/null | awk '{print int(($1-1)/65536)}' | uniq)
r crash_log_size "$(stat -c %s /mnt/log)"
cp /mnt/log /tmp/log.after-crash
(cd /mnt && sha256sum -c /tmp/sums 2>/dev/null | grep -c OK) | { read n; r crash_old_files_ok "$n"; }
r crash_kernel_errors "$(dmesg | grep -c -i -e 'I/O error' -e 'EXT4-fs error' -e 'EXT4-fs warning')"
r crash_reconnected "$(dmesg | grep -c 'reconnected socket')"

# Restart without unmounting: 'detach --keep-device' while a file is written with
# O_DIRECT (acknowledged, never flushed by the writer), then attach again. The old
# server commits every write it acknowledged before it exits, so nothing may be lost.
dmesg -c >/dev/null
rm -f /tmp/writer.at
(
	i=0
	while [ $i -lt 96 ]; do
		dd if=/tmp/src of=/mnt/log2 bs=64k skip=$i seek=$i count=1 conv=notrunc oflag=direct 2>/dev/null || { echo "fail $i" >/tmp/writer.err; exit 1; }
		echo $i >/tmp/writer.at
		i=$((i + 1))
	done
) &
writer=$!
n=0
while [ "$(cat /tmp/writer.at 2>/dev/null || echo 0)" -lt 16 ] && [ $n -lt 600 ]; do sleep 0.2; n=$((n + 1)); done
eli detach --keep-device vol >/tmp/detach5.out 2>&1
r keep_detach_rc $?
r keep_stopped_at "$(cat /tmp/writer.at)"
[ -e /sys/block/nbd0/pid ] && r keep_dev bound || r keep_dev unbound
eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 $P >/tmp/attach4.out 2>&1
rc=$?
r keep_attach_rc $rc
[ $rc -eq 0 ] || cat /tmp/attach4.out
wait $writer
r keep_writer_rc $?
umount /mnt
mount -t ext4 /dev/nbd0 /mnt
cmp -s /tmp/src /mnt/log2 && r keep_cmp ok || r keep_cmp differ
cmp -s /tmp/log.after-crash /mnt/log && r keep_crash_file ok || r keep_crash_file differ
r keep_kernel_errors "$(dmesg | grep -c -i -e 'I/O error' -e 'EXT4-fs error' -e 'EXT4-fs warning')"
r keep_reconnected "$(dmesg | grep -c 'reconnected socket')"
umount /mnt

# Grow a mounted volume. 'eli resize' refuses an attached provider; the way is a
# restart: detach --keep-device, resize the provider, attach re-plugs the device with
# its new size, and resize2fs grows the mounted filesystem.
mount -t ext4 /dev/nbd0 /mnt
old=$(cat /sys/block/nbd0/size)
eli resize --passphrase-file /tmp/pass --size 256M $P >/tmp/resize.out 2>&1
r resize_rc $?
r resize_msg "$(head -1 /tmp/resize.out)"
r resize_dev_size "$(( old * 512 ))" "$(( $(cat /sys/block/nbd0/size) * 512 ))"
fs_before=$(df -k /mnt | awk 'NR==2 {print $2}')
eli detach --keep-device vol >/tmp/detach7.out 2>&1
r grow_keep_rc $?
eli resize --passphrase-file /tmp/pass --size 256M $P >/tmp/resize2.out 2>&1
r grow_resize_rc $?
eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 $P >/tmp/attach5.out 2>&1
rc=$?
r grow_attach_rc $rc
[ $rc -eq 0 ] || cat /tmp/attach5.out
r grow_dev_size "$(( old * 512 ))" "$(( $(cat /sys/block/nbd0/size) * 512 ))"
r grow_eli_size "$(field size)"
resize2fs /dev/nbd0 >/tmp/resize2fs.out 2>&1
rc=$?
r grow_resize2fs_rc $rc
[ $rc -eq 0 ] || cat /tmp/resize2fs.out
r grow_fs_kb "$fs_before" "$(df -k /mnt | awk 'NR==2 {print $2}')"
dropcaches
(cd /mnt && sha256sum -c /tmp/sums 2>/dev/null | grep -c OK) | { read n; r grow_old_files_ok "$n"; }
dd if=/dev/urandom of=/mnt/big bs=1M count=100 conv=fsync 2>/dev/null
r grow_write_rc $?
umount /mnt

eli detach vol >/tmp/detach4.out 2>&1
r final_detach_rc $?
eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 $P >/dev/null 2>&1
e2fsck -f -n /dev/nbd0 >/tmp/fsck.out 2>&1
r fsck_rc $?

# --force detaches a mounted device anyway.
mount -t ext4 /dev/nbd0 /mnt
eli detach --force vol >/tmp/detach6.out 2>&1
r force_detach_rc $?
# (The mount keeps the device's config, and so its pid file, until it is unmounted:
# a read is what shows the disconnect.)
timeout 30 dd if=/dev/nbd0 of=/dev/null bs=4k count=1 iflag=direct 2>/dev/null && r force_dev readable || r force_dev disconnected
[ -e "$ELI_STATE_DIR/vol.json" ] && r force_server alive || r force_server gone
timeout 30 umount /mnt 2>/dev/null || timeout 30 umount -l /mnt 2>/dev/null

# eli as a generated unit runs it: attach --foreground --device auto. This guest has no
# udev, so eli names /dev/eli/svc itself. A stop (SIGTERM) while the file system is
# mounted leaves the device connected; the next attach finds the device waiting for
# this volume and re-plugs it; a stop with nothing mounted disconnects it. (/bin/eli, not
# the function eli: $! must be eli's own pid.)
svc_link() { readlink /dev/eli/svc 2>/dev/null || echo none; }
svc_wait() { n=0; while [ "$(svc_link)" = none ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n + 1)); done; }
dmesg -c >/dev/null
/bin/eli attach --foreground --passphrase-file /tmp/pass --name svc --device auto $P >/tmp/svc1.out 2>&1 &
svc=$!
svc_wait
dev=$(svc_link)
r svc_link "$dev"
mount -t ext4 /dev/eli/svc /mnt
r svc_mount_rc $?
dd if=/dev/urandom of=/mnt/svc bs=64k count=16 conv=fsync 2>/dev/null
sha256sum /mnt/svc >/tmp/svc.sum
kill -TERM $svc
wait $svc
r svc_busy_stop_rc $?
[ -e "/sys/block/${dev#../}/pid" ] && r svc_busy_dev bound || r svc_busy_dev unbound
r svc_busy_link "$(svc_link)"
/bin/eli attach --foreground --passphrase-file /tmp/pass --name svc --device auto $P >/tmp/svc2.out 2>&1 &
svc=$!
n=0; while [ ! -e "$ELI_STATE_DIR/svc.json" ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n + 1)); done
r svc_restart_link "$(svc_link)"
dropcaches
sha256sum -c /tmp/svc.sum >/dev/null 2>&1 && r svc_restart_file ok || r svc_restart_file differ
dd if=/dev/urandom of=/mnt/svc2 bs=64k count=16 conv=fsync 2>/dev/null
r svc_restart_write_rc $?
r svc_kernel_errors "$(dmesg | grep -c -i -e 'I/O error' -e 'EXT4-fs error')"
r svc_reconnected "$(dmesg | grep -c 'reconnected socket')"
umount /mnt
kill -TERM $svc
wait $svc
r svc_idle_stop_rc $?
[ -e "/sys/block/${dev#../}/pid" ] && r svc_idle_dev bound || r svc_idle_dev unbound
r svc_idle_link "$(svc_link)"
r svc_busy_log "$(grep -c 'the kernel device is in use: leaving it connected' /tmp/svc1.out)"
[ -e "$ELI_STATE_DIR/svc.json" ] && r svc_server alive || r svc_server gone
exit 0

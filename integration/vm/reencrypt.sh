#!/bin/sh
# /init of TestVMReencrypt's guest: ext4 mounted on /dev/nbd0 through a whole online
# re-encryption of its eli volume, with a writer fsyncing all along, the server killed
# with -9 halfway and re-plugged by a new attach, which resumes the re-encryption. It
# prints "ELI-RESULT key value..." lines; integration/vm_reencrypt_test.go judges them.
. /lib/eli-prelude.sh
watchdog 480
load_modules

P=/tmp/disk.img
echo "vm test passphrase" >/tmp/pass
eli() { /bin/eli "$@"; }
attach() { eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 --connections 2 $P; }
field() { grep -o "\"$1\": *[0-9]*" "$ELI_STATE_DIR/vol.json" | grep -o '[0-9]*$'; }
dropcaches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
state() { eli status --json vol 2>/dev/null | tr -d ' \n' | grep -o '"reencrypt":{"state":"[a-z]*"' | grep -o '[a-z]*"$' | tr -d '"'; }
wait_state() { n=0; while [ "$(state)" != "$1" ] && [ $n -lt 1200 ]; do sleep 0.2; n=$((n + 1)); done; }

eli init --passphrase-file /tmp/pass --kdf-time 1 --kdf-memory 8 --kdf-threads 1 --size 256M $P >/tmp/init.out 2>&1
r init_rc $?
attach >/tmp/attach.out 2>&1
rc=$?
r attach_rc $rc
[ $rc -eq 0 ] || { cat /tmp/attach.out; exit 0; }
mkfs.ext4 -q -F -E nodiscard /dev/nbd0 >/tmp/mkfs.out 2>&1
r mkfs_rc $?
mount -t ext4 /dev/nbd0 /mnt
rc=$?
r mount_rc $rc
[ $rc -eq 0 ] || exit 0
dd if=/dev/urandom of=/mnt/a bs=1M count=96 conv=fsync 2>/dev/null
dd if=/dev/urandom of=/mnt/b bs=4k count=37 conv=fsync 2>/dev/null
mkdir /mnt/d && for i in 1 2 3 4 5 6 7 8; do dd if=/dev/urandom of=/mnt/d/$i bs=16k count=$i 2>/dev/null; done
sync
(cd /mnt && sha256sum a b d/*) >/tmp/sums
dropcaches
dmesg -c >/dev/null

# A writer that fsyncs each 64 KiB piece, from before the start to after the end.
dd if=/dev/urandom of=/tmp/src bs=64k count=256 2>/dev/null
(
	i=0
	while [ $i -lt 256 ]; do
		dd if=/tmp/src of=/mnt/w bs=64k skip=$i seek=$i count=1 conv=notrunc,fsync 2>/dev/null || { echo "fail $i" >/tmp/writer.err; exit 1; }
		echo $i >/tmp/writer.at
		i=$((i + 1))
		if [ -e /tmp/writer.slow ]; then sleep 0.05; fi
	done
) &
writer=$!
touch /tmp/writer.slow

eli reencrypt --passphrase-file /tmp/pass --max-rate 8M --detach vol >/tmp/re1.out 2>&1
r reencrypt_rc $?
r reencrypt_msg "$(head -1 /tmp/re1.out)"
wait_state running
r state_running "$(state)"
eli list >/tmp/list.out 2>&1
grep -q 're-encrypting' /tmp/list.out && r list_says re-encrypting || r list_says "$(cat /tmp/list.out)"
eli reencrypt --passphrase-file /tmp/pass vol >/tmp/re2.out 2>&1
r second_rc $?
r second_msg "$(head -1 /tmp/re2.out)"

# kill -9 halfway; a new attach re-plugs the mounted device and resumes the re-encryption.
n=0
while ! eli status vol 2>/dev/null | grep -q 'running: [1-9]' && [ $n -lt 600 ]; do sleep 0.2; n=$((n + 1)); done
r killed_status "$(eli status vol | grep re-encryption: | cut -c1-60)"
kill -9 "$(field pid)"
sleep 1
eli dump $P >/tmp/dump1.out 2>&1
grep -q 'under way' /tmp/dump1.out && r killed_halfway yes || r killed_halfway no
attach >/tmp/attach2.out 2>&1
rc=$?
r reattach_rc $rc
[ $rc -eq 0 ] || cat /tmp/attach2.out
r resumed_state "$(state)"
rm -f /tmp/writer.slow
wait_state done
r final_state "$(state)"
eli status vol >/tmp/status.out 2>&1
r status_done "$(grep -c 'done at' /tmp/status.out)"
wait $writer
r writer_rc $?
r writer_at "$(cat /tmp/writer.at)"

eli dump $P >/tmp/dump2.out 2>&1
r dump_epoch "$(grep 'key epoch:' /tmp/dump2.out | grep -o '[0-9]*')"
grep -q 're-encryption:  none' /tmp/dump2.out && r dump_reencryption none || r dump_reencryption "$(grep re-encryption: /tmp/dump2.out)"
cmp -s /tmp/src /mnt/w && r writer_cmp_cached ok || r writer_cmp_cached differ
dropcaches
(cd /mnt && sha256sum -c /tmp/sums >/dev/null 2>&1) && r sums ok || r sums bad
cmp -s /tmp/src /mnt/w && r writer_cmp ok || r writer_cmp differ
# (A request in flight to the killed server is re-sent once the kernel times it out:
# "Connection timed out, retrying", which is no error.)
r kernel_errors "$(dmesg | grep -c -i -e 'I/O error' -e 'EXT4-fs error' -e 'EXT4-fs warning')"
umount /mnt
r umount_rc $?
eli detach vol >/tmp/detach.out 2>&1
r detach_rc $?
# The old key is gone: a new attach opens the new one, and the filesystem is clean.
attach >/tmp/attach3.out 2>&1
r attach_after_rc $?
e2fsck -f -n /dev/nbd0 >/tmp/fsck.out 2>&1
rc=$?
r fsck_rc $rc
[ $rc -eq 0 ] || cat /tmp/fsck.out
mount -t ext4 /dev/nbd0 /mnt
(cd /mnt && sha256sum -c /tmp/sums >/dev/null 2>&1) && r sums_after ok || r sums_after bad
cmp -s /tmp/src /mnt/w && r writer_cmp_after ok || r writer_cmp_after differ
umount /mnt
eli detach vol >/dev/null 2>&1
r final_detach_rc $?
exit 0

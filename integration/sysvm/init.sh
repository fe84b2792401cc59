#!/bin/sh
# sysvm's initramfs: load the drivers of the root disk, mount it, and hand over to the
# root file system's systemd. A failure ends this script, which panics the kernel, which
# (panic=-1, qemu -no-reboot) ends qemu: the test sees qemu gone before its agent.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
while read -r m; do
	insmod "/lib/sysvm/$m" || echo "sysvm-initramfs: insmod $m failed"
done </lib/sysvm/order
root=/dev/vda
for w in $(cat /proc/cmdline); do
	case $w in root=*) root=${w#root=} ;; esac
done
i=0
while [ ! -b "$root" ] && [ $i -lt 100 ]; do
	sleep 0.1
	i=$((i + 1))
done
# Mounting replays the journal after a power cut.
if ! mount -t ext4 -o rw "$root" /newroot; then
	echo "sysvm-initramfs: cannot mount $root"
	exit 1
fi
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /sbin/init

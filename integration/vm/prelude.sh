# Sourced first by the /init of every VM test's guest (guest.sh, suspend.sh): the filesystems
# busybox and eli need, the result lines, the power-off at exit, a hang guard, and the
# modules the tests load (newGuest puts them in /lib/eli-modules, in load order).
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /tmp /run /mnt
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs dev /dev
mount -t tmpfs -o size=900m tmp /tmp
mount -t tmpfs run /run
export ELI_STATE_DIR=/run/eli

r() { echo "ELI-RESULT $*"; }
fin() { r done; sync; poweroff -f; sleep 60; }
trap fin EXIT

# watchdog SECONDS: whatever wedges, the VM powers off after SECONDS and the test reports
# what it saw.
watchdog() { (sleep "$1"; echo "ELI-RESULT watchdog fired"; dmesg | tail -40; poweroff -f) & }

load_modules() {
	for m in $(cat /lib/eli-modules/order); do
		insmod "/lib/eli-modules/$m" || r insmod_failed "$m"
	done
	r kernel "$(uname -r)"
}

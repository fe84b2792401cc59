#!/bin/sh
# /init of TestVMReceiveStarvation's guest: Linux 6.1's nbd receive work when the kernel is
# slow to create worker threads. It reports; the test judges.
. /lib/eli-prelude.sh
watchdog 400
load_modules
P=/tmp/disk.img
echo "vm test passphrase" >/tmp/pass
eli() { /bin/eli "$@"; }
# The connections per device: eli.connections=N on the kernel's command line, else 2.
CONNS=2
for a in $(cat /proc/cmdline); do
	case "$a" in eli.connections=*) CONNS=${a#eli.connections=} ;; esac
done
eli init --passphrase-file /tmp/pass --kdf-time 1 --kdf-memory 8 --kdf-threads 1 --sector-size 4096 --size 64M $P >/tmp/init.out 2>&1 || { cat /tmp/init.out; exit 0; }

# round NAME SLOW: attach with $CONNS connections (with SLOW=1, kthreadd at nice 19 behind four
# busy loops, so that creating a worker thread takes long), then report how many threads
# run nbd0's receive work (a worker's comm ends in +nbd0-recv while it runs one; the
# workqueue's rescuer is named nbd0-recv itself), and how long a 4 KiB O_DIRECT read from
# each CPU takes: with two connections, each CPU sends on its own; and whether eli's log
# said that the kernel reads only some connections.
warnings() { n=$(grep -c 'reads replies on only some' "$ELI_STATE_DIR/vol.log" 2>/dev/null); echo "${n:-0}"; }
round() {
	name=$1 pids="" warned=$(warnings)
	if [ "$2" = 1 ]; then
		renice -n 19 -p 2 >/dev/null
		for i in 1 2 3 4; do (while :; do :; done) & pids="$pids $!"; done
	fi
	eli attach --passphrase-file /tmp/pass --name vol --device /dev/nbd0 --connections $CONNS $P >/tmp/attach.out 2>&1
	r ${name}_attach_rc $?
	sleep 2
	for p in $pids; do kill $p; done
	renice -n 0 -p 2 >/dev/null
	sleep 1
	running=0 rescuer=0
	for d in /proc/[0-9]*; do
		[ -s "$d/cmdline" ] && continue
		c=$(cat "$d/comm" 2>/dev/null)
		case "$c" in
		nbd0-recv+nbd0-recv) running=$((running + 1)) rescuer=1 ;;
		*+nbd0-recv) running=$((running + 1)) ;;
		esac
	done
	r ${name}_receiving "$running"
	r ${name}_rescuer "$rescuer"
	before=$(dmesg | grep -c 'timed out')
	slowest=0 failed=""
	for cpu in 0 1; do
		s=$(date +%s)
		taskset -c $cpu dd if=/dev/nbd0 of=/dev/null bs=4k count=1 skip=$((cpu * 100 + 7)) iflag=direct 2>/dev/null || { r ${name}_read_failed $cpu; failed=1; }
		t=$(( $(date +%s) - s ))
		[ $t -gt $slowest ] && slowest=$t
	done
	r ${name}_slowest_read "$slowest"
	r ${name}_timeouts "$(( $(dmesg | grep -c 'timed out') - before ))"
	r ${name}_warned "$(( $(warnings) - warned ))"
	if [ -n "$failed" ]; then
		# What the server and the kernel said, for the test to show.
		echo ELI-SERVER-LOG-BEGIN
		cat "$ELI_STATE_DIR/vol.log"
		dmesg | grep -i -e nbd -e block | tail -40
		echo ELI-SERVER-LOG-END
	fi
	eli detach vol >/tmp/detach.out 2>&1 || { r ${name}_detach_failed; cat /tmp/detach.out; }
}
# The first attach after boot: the pool of unbound high-priority workers has one idle
# worker, which must create another before it runs the first receive work.
round slow 1
# The same attach again: the workers the first one made are idle now.
round again 0

#!/usr/bin/env bash
# Measures what a client spends writing into eli (issue 19): nbdcopy --flush of SIZE of
# random data into eli none and into nbdkit's file plugin, both on tmpfs, in alternating
# rounds with a fresh server each time. Every line gives the copy's throughput, nbdcopy's
# own CPU time (user + system, from wait4's rusage) and the server's (from /proc/PID/stat),
# both per GB, and the round's ratio of nbdcopy's CPU into eli none to into nbdkit file.
#
#   Usage: bench/copycpu.sh
#   Environment: SIZE (default 1G), ROUNDS (6), ELI (binary; default: go build ./cmd/eli),
#                DIR (tmpfs, default /dev/shm), NBDCOPY_FLAGS (more nbdcopy options, such
#                as --connections=1), PIN=split (nbdcopy on CPU 0, every thread of the
#                server on CPU 1: the same placement for both servers, where otherwise the
#                kernel's placement of each server's threads beside nbdcopy's differs).
#
# The ratio to quote is the median of the rounds' ratios: the machine's load moves both
# servers alike within a round.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-6}

. bench/common.sh
bench_setup copycpu
truncate -s $((bytes + bytes / 16)) "$work/none.img"
"$eli" init --cipher none --unsafe "${kdf[@]}" "$work/none.img" >/dev/null 2>&1

# serve TARGET: starts eli none or nbdkit file (kit) on a unix socket; sets pid and sock.
client_pin=()
case ${PIN:-} in
'') ;;
split) client_pin=(taskset -c 0) ;;
*)
	echo "PIN=$PIN: want split or nothing" >&2
	exit 2
	;;
esac

serve_target() {
	case $1 in
	none) serve_eli none ;;
	kit) serve kit nbdkit -f -U "$work/kit.sock" file file="$work/kit.img" ;;
	esac
	# Threads the server starts later inherit the affinity of the thread that starts them.
	[ -z "${PIN:-}" ] || taskset -a -p -c 1 "$pid" >/dev/null
}

# copy: one nbdcopy into the server at sock; prints seconds, nbdcopy's CPU seconds.
copy() {
	python3 - "$work/src" "nbd+unix:///?socket=$sock" "${client_pin[@]}" nbdcopy --flush ${NBDCOPY_FLAGS:-} <<'EOF'
import os, sys, time
t0 = time.monotonic()
argv = [*sys.argv[3:], sys.argv[1], sys.argv[2]]
pid = os.spawnvp(os.P_NOWAIT, argv[0], argv)
_, status, ru = os.wait4(pid, 0)
if status != 0:
    sys.exit(f"nbdcopy exited with status {status}")
print(time.monotonic() - t0, ru.ru_utime + ru.ru_stime)
EOF
}

# nbdkit's export is as large as eli's, so that the two copies differ in nothing else.
serve_target none
truncate -s "$(nbdinfo --size "nbd+unix:///?socket=$sock")" "$work/kit.img"
unserve

hz=$(getconf CLK_TCK)
gb=$(python3 -c "print($bytes / 1e9)")
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
# One warm-up copy each: fills both backing files, so that every measured copy
# overwrites allocated pages.
for t in kit none; do
	serve_target "$t"
	copy >/dev/null
	unserve
done
ratios=()
for r in $(seq "$rounds"); do
	order=(kit none)
	[ $((r % 2)) -eq 1 ] || order=(none kit)
	for t in "${order[@]}"; do
		serve_target "$t"
		t0=$(cputicks "$pid")
		read -r secs client < <(copy)
		t1=$(cputicks "$pid")
		unserve
		read -r mbs cms sms < <(python3 -c "print($bytes / $secs / 1e6, $client / $gb * 1e3, ($t1 - $t0) / $hz / $gb * 1e3)")
		printf 'round %d %-4s: %6.0f MB/s  nbdcopy CPU %5.0f ms/GB  server CPU %5.0f ms/GB\n' "$r" "$t" "$mbs" "$cms" "$sms"
		eval "client_$t=$cms"
	done
	ratio=$(python3 -c "print($client_none / $client_kit)")
	ratios+=("$ratio")
	printf 'round %d nbdcopy CPU into eli none / into nbdkit file: %.3f\n' "$r" "$ratio"
done
python3 -c "
import statistics, sys
r = sorted(float(x) for x in sys.argv[1:])
print(f'nbdcopy CPU into eli none / into nbdkit file: median {statistics.median(r):.3f} ({r[0]:.3f}-{r[-1]:.3f}) over {len(r)} rounds')
" "${ratios[@]}"

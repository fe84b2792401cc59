#!/usr/bin/env bash
# Measures issue 19's sequential targets in one run: nbdcopy writes (--flush, from a file
# of random bytes) into and reads (--no-extents, to null:) out of eli none,
# xchacha20-poly1305 format 1 and format 2 on tmpfs providers, in alternating rounds, with
# the server's CPU per GB of each (user + system, /proc/PID/stat). Each round also times
# the codec on its own (eli bench, one thread, 4 KiB sectors), so that
#
#   prediction = eli none's CPU per GB + the codec's CPU per GB
#
# comes from the same minutes as what it is compared with. The summary gives, for each
# mode, the median over rounds of its CPU per GB against that round's prediction, and of
# its MB/s against eli none's (reads: issue 19 asks for at least 0.7).
#
#   Usage: bench/seqio.sh   Environment: SIZE (default 1G), ROUNDS (5), ELI, DIR (as in
#          bench/common.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-5}

. bench/common.sh
bench_setup seqio

# The first copy fills each provider, so that every measured write overwrites data.
prefilled_volumes

# measure VOL write|read: prints "MB/s CPU-ms-per-GB" of one copy.
measure() {
	serve_eli "$1"
	local t0 t1 s0 s1
	t0=$(cputicks "$pid")
	s0=$(date +%s.%N)
	if [ "$2" = write ]; then
		nbdcopy --flush "$work/src" "nbd+unix:///?socket=$sock"
	else
		nbdcopy --no-extents "nbd+unix:///?socket=$sock" null:
	fi
	s1=$(date +%s.%N)
	t1=$(cputicks "$pid")
	unserve
	python3 -c "print($bytes / ($s1 - $s0) / 1e6, ($t1 - $t0) / $(getconf CLK_TCK) / ($bytes / 1e9) * 1e3)"
}

out=$work/results
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
	codec=$("$eli" bench --cipher xchacha20-poly1305 --sector-size 4096 --threads 1 --duration 1s --json)
	read -r seal open < <(python3 -c "
import json, sys
for m in json.loads(sys.argv[1])['results']:
    if m['sector_size'] == 4096:
        print(1e3 / (m['encrypt_mbps'] / 1e3), 1e3 / (m['decrypt_mbps'] / 1e3))
" "$codec")
	printf 'round %d codec: seal %4.0f ms/GB, open %4.0f ms/GB (one thread)\n' "$r" "$seal" "$open"
	echo "$r codec - $seal $open" >>"$out"
	for rw in write read; do
		for v in "${vols[@]}"; do
			read -r mbs cpu < <(measure "$v" "$rw")
			printf 'round %d seq %-5s %-4s: %6.0f MB/s  server CPU %5.0f ms/GB\n' "$r" "$rw" "$v" "$mbs" "$cpu"
			echo "$r $rw $v $mbs $cpu" >>"$out"
		done
	done
done
python3 - "$out" <<'EOF'
import collections, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
codec = {r: (float(s), float(o)) for r, rw, _, s, o in rows if rw == "codec"}
got = {(r, rw, v): (float(m), float(c)) for r, rw, v, m, c in rows if rw != "codec"}
for rw, k in (("write", 0), ("read", 1)):
    for v in ("x1", "x2"):
        pred, speed = [], []
        for r in codec:
            none_mbs, none_cpu = got[(r, rw, "none")]
            mbs, cpu = got[(r, rw, v)]
            pred.append(cpu / (none_cpu + codec[r][k]))
            speed.append(mbs / none_mbs)
        print(f"seq {rw} {v}: CPU/prediction median {statistics.median(pred):.3f} "
              f"({min(pred):.3f}-{max(pred):.3f}), MB/s / eli none median {statistics.median(speed):.3f} "
              f"({min(speed):.3f}-{max(speed):.3f}) over {len(pred)} rounds")
EOF

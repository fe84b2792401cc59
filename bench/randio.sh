#!/usr/bin/env bash
# Measures eli's per-request overhead (issue 19): 4 KiB random I/O through fio's nbd
# engine on three volumes side by side, eli none, xchacha20-poly1305 format 1 and format
# 2, each on a tmpfs provider prefilled with SIZE of random data. Rounds alternate the
# volumes, so that load from other jobs falls on all three alike; every line gives IOPS,
# completion-latency percentiles, the server's CPU time per I/O (user + system, from
# /proc/PID/stat, which counts every thread of the server, over fio's 1 s ramp too: a
# slight overstatement, alike for all three), fio's own CPU time per I/O (its usr_cpu and
# sys_cpu over its runtime) and the share of the machine's CPUs left idle (/proc/stat, over
# the same span as the server's CPU): where fio and the server share the cores, IOPS follow
# the sum of the two CPU times as long as nothing idles.
#
#   Usage: bench/randio.sh [WORKLOAD...]   (default: randwrite:32 randwrite:1 randread:32
#          randread:1 syncwrite:1; RW:QD, where syncwrite is randwrite with a flush after
#          every write)
#   Environment: SIZE (default 1G), RUNTIME (seconds per fio run, default 5), ROUNDS (3),
#                ELI (binary; default: go build ./cmd/eli), DIR (tmpfs, default /dev/shm).
#
# Ratios to quote are xchacha/none of the same round; the summary at the end gives their
# medians and ranges. The server's CPU per I/O tells where a ratio comes from on a machine
# whose two cores fio shares with the server.
set -euo pipefail
cd "$(dirname "$0")/.."
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(randwrite:32 randwrite:1 randread:32 randread:1 syncwrite:1)
runtime=${RUNTIME:-5}
rounds=${ROUNDS:-3}

. bench/common.sh
bench_setup randio

prefilled_volumes
rm -f "$work/src"

hz=$(getconf CLK_TCK)
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
for w in "${workloads[@]}"; do
	rw=${w%%:*} qd=${w##*:}
	# syncwrite: random writes with a flush after each (a database's log, a VM's sync
	# writes), which waits for a commit every time.
	fiorw=$rw sync=0
	[ "$rw" != syncwrite ] || fiorw=randwrite sync=1
	for r in $(seq "$rounds"); do
		for v in "${vols[@]}"; do
			serve_eli "$v"
			t0=$(cputicks "$pid")
			s0=$(head -1 /proc/stat)
			out=$(fio --name=randio --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw="$fiorw" --bs=4k \
				--fsync="$sync" --iodepth="$qd" --numjobs=1 --size="$bytes" --time_based --runtime="${runtime}s" \
				--ramp_time=1s --output-format=json 2>/dev/null)
			t1=$(cputicks "$pid")
			s1=$(head -1 /proc/stat)
			unserve
			python3 - "$v" "$rw" "$qd" "$r" $((t1 - t0)) "$hz" "$out" "$s0" "$s1" <<'EOF' | tee -a "$work/results"
import json, sys
v, rw, qd, r, ticks, hz, out, s0, s1 = sys.argv[1:]
job = json.loads(out[out.index("{"):])["jobs"][0]
if job["error"]:
    sys.exit(f"fio {rw} on {v}: error {job['error']}")
x = job["read" if rw.endswith("read") else "write"]
p = x["clat_ns"]["percentile"]
cpu = int(ticks) / int(hz) * 1e6 / x["total_ios"]
fio = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] * 1e3 / x["total_ios"]
# /proc/stat's first line: user nice system idle iowait irq softirq steal ...
d = [int(b) - int(a) for a, b in zip(s0.split()[1:9], s1.split()[1:9])]
idle = (d[3] + d[4]) / sum(d) * 100
print(f"{rw} qd{qd} round {r} {v:4}: {x['iops']:8.0f} IOPS  p50 {p['50.000000']/1e3:6.0f} us"
      f"  p99 {p['99.000000']/1e3:6.0f} us  p99.9 {p['99.900000']/1e3:6.0f} us  server CPU {cpu:5.1f} us/IO"
      f"  fio CPU {fio:5.1f} us/IO  idle {idle:3.0f}%")
EOF
		done
	done
done

# The summary: per workload, each volume's medians, and the medians (and ranges) of the
# rounds' x1/none and x2/none ratios of IOPS and of p99 latency.
python3 - "$work/results" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(dict)  # (rw, qd) -> {(round, vol): (iops, p99, cpu)}
for l in open(sys.argv[1]):
    f = l.replace(":", " ").split()
    rw, qd, r, v = f[0], f[1], f[3], f[4]
    runs[(rw, qd)][(r, v)] = (float(f[5]), float(f[f.index("p99") + 1]), float(f[f.index("CPU") + 1]),
                              float(f[f.index("fio") + 2]), float(f[f.index("idle") + 1].rstrip("%")))
med = statistics.median
print("summary (medians over rounds; ratios per round, then their median and range):")
for (rw, qd), got in runs.items():
    rounds = sorted({r for r, _ in got})
    for v in ("none", "x1", "x2"):
        x = [got[(r, v)] for r in rounds]
        line = (f"{rw} {qd} {v:4}: {med(a[0] for a in x):8.0f} IOPS  p99 {med(a[1] for a in x):6.0f} us"
                f"  server CPU {med(a[2] for a in x):5.1f} us/IO  fio CPU {med(a[3] for a in x):5.1f} us/IO  idle {med(a[4] for a in x):3.0f}%")
        if v != "none":
            iops = sorted(got[(r, v)][0] / got[(r, "none")][0] for r in rounds)
            p99 = sorted(got[(r, v)][1] / got[(r, "none")][1] for r in rounds)
            line += f"  /none: IOPS {med(iops):.2f} ({iops[0]:.2f}-{iops[-1]:.2f}), p99 {med(p99):.2f} ({p99[0]:.2f}-{p99[-1]:.2f})"
        print(line)
EOF

#!/usr/bin/env bash
# Measures what a fresh server costs (issue 43): every user's first reads and writes after
# eli attach go to a server that has touched nothing yet. Each round starts a fresh server
# for eli none, eli xchacha20-poly1305 (format 2, the default) and nbdkit's file plugin
# (the plaintext reference), on tmpfs providers filled whole with random data, in an
# order that rotates from round to round, and makes PASSES passes with nbdcopy through
# it: reads (--no-extents, to null:) of the whole export, then, with another fresh
# server, writes (--flush, from a file of SIZE random bytes). Every line gives a pass's
# throughput, the server's CPU per GB (user + system, /proc/PID/stat, every thread), its
# minor page faults per GB, nbdcopy's own CPU per GB (wait4) and the share of the two
# CPUs left idle (/proc/stat).
#
#   Usage: bench/fresh.sh [read|write]...   (default: read write)
#   Environment: SIZE (default 1G), ROUNDS (5), PASSES (per server, default 2), ELI
#                (binary; default: go build ./cmd/eli), DIR (tmpfs, default /dev/shm),
#                BASE (another eli binary, such as an older build: its servers of the same
#                volumes join the rotation as none.base and x2.base, to compare two
#                builds in one run), RESULTS (a file to keep each pass's line in: round,
#                read|write, server, pass, MB/s, server CPU ms/GB, faults/GB, nbdcopy CPU
#                ms/GB, idle %).
#
# The summary gives medians and ranges over the rounds of the ratios issue 43 sets
# targets for, each from one round: a server's first pass against its later ones (CPU),
# eli none's first read against nbdkit file's (MB/s and CPU per GB), xchacha20-poly1305's
# first read against eli none's, and with BASE each pass against the base build's.
set -euo pipefail
cd "$(dirname "$0")/.."
passes=("$@")
[ ${#passes[@]} -gt 0 ] || passes=(read write)
rounds=${ROUNDS:-5}

. bench/common.sh
bench_setup fresh

npass=${PASSES:-2}
# Every export is filled whole, so that a read moves data from every part of it.
targets=(kit none x2)
[ -z "${BASE:-}" ] || targets+=(none.base x2.base)
for v in none x2; do
	truncate -s $((bytes + bytes / 16)) "$work/$v.img"
	case $v in
	none) "$eli" init --cipher none --unsafe "${kdf[@]}" "$work/$v.img" ;;
	x2) "$eli" init --format 2 "${kdf[@]}" "$work/$v.img" ;;
	esac >/dev/null 2>&1
done
serve_eli none
esize=$(nbdinfo --size "nbd+unix:///?socket=$sock")
unserve
# nbdkit's export is as large as eli none's.
truncate -s "$esize" "$work/kit.img"

serve_target() {
	case $1 in
	kit) serve kit nbdkit -f -U "$work/kit.sock" file file="$work/kit.img" ;;
	*.base) eli=$BASE serve_eli "${1%.base}" ;;
	*) serve_eli "$1" ;;
	esac
}

for t in kit none x2; do
	serve_target "$t"
	size=$(nbdinfo --size "nbd+unix:///?socket=$sock")
	head -c "$size" /dev/urandom | nbdcopy --flush -- - "nbd+unix:///?socket=$sock"
	eval "size_$t=$size"
	unserve
done

# pass read|write: one nbdcopy through the server at sock; prints MB/s, the server's CPU
# ms per GB, its minor page faults per GB, nbdcopy's CPU ms per GB and the share of the
# machine's CPUs left idle meanwhile (/proc/stat): where the client and the server share
# two cores, MB/s follow the sum of their CPU times as long as nothing idles.
pass() {
	local n args
	if [ "$1" = write ]; then
		n=$bytes args=(--flush "$work/src" "nbd+unix:///?socket=$sock")
	else
		n=$size args=(--no-extents "nbd+unix:///?socket=$sock" null:)
	fi
	python3 - "$pid" "$n" nbdcopy "${args[@]}" <<'EOF'
import os, sys, time
pid, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def server():  # user + system seconds, minor faults (proc(5))
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"), int(f[7])
def cpus():  # idle and all ticks, from /proc/stat's first line: user nice system idle iowait ...
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return v[3] + v[4], sum(v)
(c0, f0), (i0, a0), t0 = server(), cpus(), time.monotonic()
child = os.spawnvp(os.P_NOWAIT, argv[0], argv)
_, status, ru = os.wait4(child, 0)
t1, (c1, f1), (i1, a1) = time.monotonic(), server(), cpus()
if status != 0:
    sys.exit(f"nbdcopy exited with status {status}")
g = n / 1e9
print(n / (t1 - t0) / 1e6, (c1 - c0) / g * 1e3, (f1 - f0) / g, (ru.ru_utime + ru.ru_stime) / g * 1e3,
      (i1 - i0) / max(a1 - a0, 1) * 100)
EOF
}

out=${RESULTS:-$work/results}
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
	for rw in "${passes[@]}"; do
		for k in "${!targets[@]}"; do
			t=${targets[$(((k + r) % ${#targets[@]}))]}
			serve_target "$t"
			eval "size=\$size_${t%.base}"
			for p in $(seq "$npass"); do
				read -r mbs cpu flt client idle < <(pass "$rw")
				printf 'round %d %-5s %-4s pass %d: %5.0f MB/s  server CPU %4.0f ms/GB  faults %6.0f /GB  nbdcopy CPU %4.0f ms/GB  idle %2.0f%%\n' \
					"$r" "$rw" "$t" "$p" "$mbs" "$cpu" "$flt" "$client" "$idle"
				echo "$r $rw $t $p $mbs $cpu $flt $client $idle" >>"$out"
			done
			unserve
		done
	done
done

python3 - "$out" <<'EOF'
import statistics, sys
got = {}
for l in open(sys.argv[1]):
    r, rw, t, p, *v = l.split()
    got[(r, rw, t, p)] = tuple(float(x) for x in v)
rounds = sorted({k[0] for k in got})
def line(name, f):
    v = []
    for r in rounds:
        try:
            v.append(f(lambda rw, t, p: got[(r, rw, t, p)]))
        except KeyError:
            pass
    if v:
        print(f"{name}: median {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) over {len(v)} rounds")
targets = sorted({k[2] for k in got}, key=lambda t: ("kit", "none", "x2", "none.base", "x2.base").index(t))
passes = sorted({k[3] for k in got})
for rw in ("read", "write"):
    for t in targets:
        for p in passes[1:]:
            line(f"{rw} {t}: first / pass {p}, server CPU", lambda g: g(rw, t, "1")[1] / g(rw, t, p)[1])
for b in ("", ".base"):
    none, x2 = "none" + b, "x2" + b
    line(f"first read, eli {none} / nbdkit file, MB/s", lambda g: g("read", none, "1")[0] / g("read", "kit", "1")[0])
    line(f"first read, nbdkit file / eli {none}, server CPU per GB", lambda g: g("read", "kit", "1")[1] / g("read", none, "1")[1])
    line(f"first read, {x2} / eli {none}, MB/s", lambda g: g("read", x2, "1")[0] / g("read", none, "1")[0])
    line(f"first read, eli {none} / {x2}, server CPU per GB", lambda g: g("read", none, "1")[1] / g("read", x2, "1")[1])
    # Where the server and nbdcopy keep both CPUs busy between them, MB/s go as 1 / (the
    # server's CPU per GB + nbdcopy's): the ratio of MB/s that the CPU time alone allows.
    line(f"first read, eli {none} / nbdkit file, MB/s that the CPU time allows",
         lambda g: (g("read", "kit", "1")[1] + g("read", "kit", "1")[3]) / (g("read", none, "1")[1] + g("read", none, "1")[3]))
    line(f"first read, {x2} / eli {none}, MB/s that the CPU time allows",
         lambda g: (g("read", none, "1")[1] + g("read", none, "1")[3]) / (g("read", x2, "1")[1] + g("read", x2, "1")[3]))
for rw in ("read", "write"):
    for t in ("none", "x2"):
        for p in passes:
            line(f"{rw} {t} pass {p}: server CPU against {t}.base", lambda g: g(rw, t, p)[1] / g(rw, t + ".base", p)[1])
for rw in ("read", "write"):
    for t in targets:
        for p in passes:
            v = [got[k] for k in got if k[1:] == (rw, t, p)]
            if v:
                m = [statistics.median(x[i] for x in v) for i in range(5)]
                print(f"{rw} {t:4} pass {p}, medians: {m[0]:5.0f} MB/s, server CPU {m[1]:4.0f} ms/GB, "
                      f"faults {m[2]:6.0f} /GB, nbdcopy CPU {m[3]:4.0f} ms/GB, idle {m[4]:2.0f}%")
EOF

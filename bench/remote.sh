#!/usr/bin/env bash
# Benchmarks eli over a remote provider against the same export used directly (issue 15):
# nbdkit's file plugin behind its delay filter (every read and write delayed by DELAY;
# flushes are not delayed: the filter has no knob for them) over TCP on 127.0.0.1.
#
#   sequential write: nbdcopy --flush of SIZE of random data to the export directly, and
#                     to eli's export (unix socket) whose provider is that export
#   random write:     fio's nbd engine, 4 KiB random writes at queue depth 32 for
#                     RUNTIME seconds, directly and through eli, and a flush at the end
#                     (end_fsync), so that eli's pending batch is committed within the
#                     run rather than charged to the next one
#
# Beside them, the sequential copy also goes through three relays that stand where eli
# stands (a unix socket in front, the export behind) and do no cryptography: nbdkit's nbd
# plugin, qemu-nbd with the export as its image, and eli in mode none. They say what
# relaying alone costs on this machine, whatever the relay does with the bytes.
#
# Every relay's provider is a file of its own, served by the one nbdkit. Runs alternate
# direct, the relays and eli, REPEAT times per delay, and report every figure, the
# medians, and the median of the ratios to the direct run of the same round (which the
# machine's changing load affects less than the ratio of medians). Sequential runs also
# give the CPU seconds of nbdcopy, nbdkit and the relay (user + system).
# Usage: bench/remote.sh [DELAY...] (default: 1ms 5ms).
# Environment: SIZE (default 256M), RUNTIME (10), REPEAT (3), MODE (eli's cipher mode).
set -euo pipefail
cd "$(dirname "$0")/.."
delays=("$@")
[ ${#delays[@]} -gt 0 ] || delays=(1ms 5ms)
size=${SIZE:-256M}
runtime=${RUNTIME:-10}
repeat=${REPEAT:-3}
mode=${MODE:-xchacha20-poly1305}

work=$(mktemp -d /dev/shm/eli-remote-bench.XXXXXX)
export ELI_STATE_DIR=$work/state
mkdir -m 700 "$ELI_STATE_DIR"
nbdkit_pid= relay_pids=()
cleanup() {
	[ -n "$nbdkit_pid" ] && kill "$nbdkit_pid" "${relay_pids[@]}" 2>/dev/null || true
	./eli-bench-bin detach --force bench >/dev/null 2>&1 || true
	./eli-bench-bin detach --force bench-none >/dev/null 2>&1 || true
	rm -rf "$work" ./eli-bench-bin
}
trap cleanup EXIT
go build -o ./eli-bench-bin ./cmd/eli
eli=./eli-bench-bin
echo pass >"$work/pass"
head -c "$size" /dev/urandom >"$work/src" 2>/dev/null || true
bytes=$(stat -c %s "$work/src")

port=$((20000 + RANDOM % 20000))
# One nbdkit serves a file for each (the file plugin's dir=: the export name is the
# file's name), so that no run overwrites the volume another relay is serving.
start_nbdkit() { # delay
	rm -rf "$work/exports"
	mkdir "$work/exports"
	(cd "$work/exports" && truncate -s 1G direct.img eli.img none.img nbdkit.img qemu.img)
	nbdkit -f -i 127.0.0.1 -p "$port" --filter=delay file dir="$work/exports" \
		delay-read="$1" delay-write="$1" delay-zero="$1" delay-trim="$1" &
	nbdkit_pid=$!
	for _ in $(seq 100); do nbdinfo --size "nbd://127.0.0.1:$port/direct.img" >/dev/null 2>&1 && return; sleep 0.1; done
	echo "nbdkit did not start" >&2
	exit 1
}

now() { date +%s.%N; }
hz=$(getconf CLK_TCK)
ticks() { [ -z "$1" ] && echo 0 || awk '{print $14 + $15}' "/proc/$1/stat"; }
# seqwrite URI [RELAYPID] -> MB/s, and the CPU seconds that nbdcopy, nbdkit and the relay
# spent on the copy: on a machine whose cores the storage server, eli and the client
# share, CPU per byte decides how close a relay can come to the direct copy.
seqwrite() {
	local t0 t1 k0 k1 e0 e1 cpu
	k0=$(ticks "$nbdkit_pid") e0=$(ticks "${2:-}")
	t0=$(now)
	/usr/bin/time -f "%U %S" -o "$work/time" nbdcopy --flush "$work/src" "$1"
	t1=$(now)
	k1=$(ticks "$nbdkit_pid") e1=$(ticks "${2:-}")
	cpu=$(awk '{print $1 + $2}' "$work/time")
	python3 -c "print(f'{$bytes/($t1-$t0)/1e6:.0f} cpu {$cpu:.2f}+{($k1-$k0)/$hz:.2f}+{($e1-$e0)/$hz:.2f}')"
}
# randwrite URI -> IOPS
randwrite() {
	fio --name=rw --ioengine=nbd --uri="$1" --rw=randwrite --bs=4k --iodepth=32 --size=512M --end_fsync=1 \
		--time_based --runtime="$runtime" --output-format=json 2>/dev/null |
		python3 -c 'import json,sys; s=sys.stdin.read(); print(round(json.loads(s[s.index("{"):])["jobs"][0]["write"]["iops"]))'
}
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "# $(date -u +%FT%TZ) $(nproc) CPUs, $(uptime | sed 's/.*load/load/'); eli mode $mode; $size sequential, ${runtime}s random"
for d in "${delays[@]}"; do
	start_nbdkit "$d"
	export_="nbd://127.0.0.1:$port"
	direct="$export_/direct.img"
	remote="$export_/eli.img"
	$eli init --passphrase-file "$work/pass" --kdf-time 1 --kdf-memory 8 --cipher "$mode" \
		$( [ "$mode" = none ] && echo --unsafe ) "$remote" >/dev/null
	via=$($eli attach --passphrase-file "$work/pass" --name bench "$remote" | tail -1)
	eli_pid=$(pgrep -n -f "eli-bench-bin __serve")
	# The relays without cryptography.
	$eli init --passphrase-file "$work/pass" --kdf-time 1 --kdf-memory 8 --cipher none --unsafe \
		"$export_/none.img" >/dev/null 2>&1
	via_none=$($eli attach --passphrase-file "$work/pass" --name bench-none "$export_/none.img" 2>/dev/null | tail -1)
	none_pid=$(pgrep -n -f "eli-bench-bin __serve")
	nbdkit -f -U "$work/nbdkit.sock" nbd uri="$export_/nbdkit.img" &
	relay_pids=($!)
	qemu-nbd --persistent -k "$work/qemu.sock" -f raw "$export_/qemu.img" &
	relay_pids+=($!)
	for s in nbdkit qemu; do
		for _ in $(seq 100); do nbdinfo --size "nbd+unix:///?socket=$work/$s.sock" >/dev/null 2>&1 && break; sleep 0.1; done
	done
	ds=() es=() dr=() er=() ks=() qs=() ns=()
	for i in $(seq "$repeat"); do
		read -r x _ dc <<<"$(seqwrite "$direct")"
		ds+=("$x")
		read -r x _ kc <<<"$(seqwrite "nbd+unix:///?socket=$work/nbdkit.sock" "${relay_pids[0]}")"
		ks+=("$x")
		read -r x _ qc <<<"$(seqwrite "nbd+unix:///?socket=$work/qemu.sock" "${relay_pids[1]}")"
		qs+=("$x")
		read -r x _ nc <<<"$(seqwrite "$via_none" "$none_pid")"
		ns+=("$x")
		read -r x _ ec <<<"$(seqwrite "$via" "$eli_pid")"
		es+=("$x")
		dr+=("$(randwrite "$direct")")
		er+=("$(randwrite "$via")")
		echo "delay $d run $i: seq MB/s direct ${ds[-1]} nbdkit-nbd ${ks[-1]} qemu-nbd ${qs[-1]} eli-none ${ns[-1]} eli ${es[-1]}; randwrite IOPS direct ${dr[-1]} eli ${er[-1]}"
		echo "    seq CPU s nbdcopy+nbdkit+relay: direct $dc nbdkit-nbd $kc qemu-nbd $qc eli-none $nc eli $ec"
	done
	$eli detach bench >/dev/null
	$eli detach bench-none >/dev/null
	kill "$nbdkit_pid" "${relay_pids[@]}"
	wait "$nbdkit_pid" "${relay_pids[@]}" 2>/dev/null || true
	nbdkit_pid= relay_pids=()
	rm -f "$work/nbdkit.sock" "$work/qemu.sock"
	# Medians of each column, and the median of the ratios to the direct run of the same
	# round: a row of the throughput table, and one of the relays' sequential ratios.
	python3 - "$d" "${ds[*]}" "${es[*]}" "${dr[*]}" "${er[*]}" "${ks[*]}" "${qs[*]}" "${ns[*]}" <<'PY'
import statistics as st, sys
d = sys.argv[1]
ds, es, dr, er, ks, qs, ns = ([float(x) for x in a.split()] for a in sys.argv[2:9])
r = lambda a, b: st.median(y / x for x, y in zip(a, b))
print(f"| {d} | {st.median(ds):.0f} | {st.median(es):.0f} | {r(ds, es):.2f} | {st.median(dr):.0f} | {st.median(er):.0f} | {r(dr, er):.2f} |")
print(f"relays: | {d} | {r(ds, ks):.2f} | {r(ds, qs):.2f} | {r(ds, ns):.2f} | {r(ds, es):.2f} |")
PY
done

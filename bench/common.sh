# Sourced by bench/randio.sh, bench/seqio.sh and bench/copycpu.sh: a work directory on
# tmpfs that goes away on exit, the eli binary, a passphrase and state directory for it,
# SIZE of random data, the servers' start and stop, and the three volumes of randio and
# seqio.
#
#   bench_setup NAME   sets work, eli, kdf, bytes (and $work/src, SIZE of random data)
#   serve NAME CMD...  starts CMD (its log in $work/NAME.log) and waits for $work/NAME.sock;
#                      sets pid and sock
#   serve_eli NAME     serve NAME: eli attach of $work/NAME.img in the foreground
#   unserve            stops the server that serve started
#   cputicks PID       user + system clock ticks of PID so far
#   prefilled_volumes  sets vols=(none x1 x2) and makes $work/VOL.img of each, eli none,
#                      xchacha20-poly1305 format 1 and format 2, filled from $work/src

bench_setup() {
	work=$(mktemp -d "${DIR:-/dev/shm}/eli-$1.XXXXXX")
	pid=
	trap bench_cleanup EXIT
	eli=${ELI:-}
	if [ -z "$eli" ]; then
		eli=$work/eli
		go build -o "$eli" ./cmd/eli
	fi
	mkdir -m 700 "$work/state"
	echo bench >"$work/pass"
	kdf=(--passphrase-file "$work/pass" --kdf-time 1 --kdf-memory 8 --kdf-threads 1)
	head -c "${SIZE:-1G}" /dev/urandom >"$work/src"
	bytes=$(stat -c %s "$work/src")
}

bench_cleanup() {
	[ -z "$pid" ] || kill "$pid" 2>/dev/null || true
	rm -rf "$work"
}

serve() {
	local name=$1
	shift
	sock=$work/$name.sock
	rm -f "$sock"
	"$@" >>"$work/$name.log" 2>&1 &
	pid=$!
	for _ in $(seq 200); do [ -S "$sock" ] && return; sleep 0.05; done
	echo "the $name server did not start:" >&2
	cat "$work/$name.log" >&2
	exit 1
}

serve_eli() {
	serve "$1" env ELI_WITNESS_DIR="$work/witness" "$eli" --state-dir "$work/state" attach \
		--foreground --passphrase-file "$work/pass" --name "$1" --socket "$work/$1.sock" "$work/$1.img"
}

unserve() {
	kill "$pid"
	wait "$pid" || true
	pid=
}

cputicks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

prefilled_volumes() {
	vols=(none x1 x2)
	local v
	for v in "${vols[@]}"; do
		# 1/16 more than the data: every mode's metadata fits in that.
		truncate -s $((bytes + bytes / 16)) "$work/$v.img"
		case $v in
		none) "$eli" init --cipher none --unsafe "${kdf[@]}" "$work/$v.img" ;;
		x1) "$eli" init --format 1 "${kdf[@]}" "$work/$v.img" ;;
		x2) "$eli" init --format 2 "${kdf[@]}" "$work/$v.img" ;;
		esac >/dev/null 2>&1
		serve_eli "$v"
		nbdcopy --flush "$work/src" "nbd+unix:///?socket=$sock"
		unserve
	done
}

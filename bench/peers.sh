#!/usr/bin/env bash
# Serves one backing file through nbdmapper, nbdkit (file plugin) and qemu-nbd
# and runs the same fio nbd-engine workloads against each, in one run, so the
# ratios are measured under the same machine load.
#
#   bench/peers.sh [SIZE_MIB] [RUNTIME_S] [ROUNDS] [SETS]
#
# SETS is "plain tls" by default. plain: each peer on a unix socket. tls:
# each peer on loopback TCP with NBD_OPT_STARTTLS required and client
# certificates verified (nbdmapper --tls require --tls-ca, nbdkit --tls=require
# --tls-verify-peer, qemu-nbd --tls-creds with verify-peer), certificates made
# by openssl for the run. fio 3.33's nbd engine cannot take tls-certificates
# in its URI (libnbd refuses local files there), so fio finds the client
# certificate in libnbd's default directory: $HOME/.pki/libnbd for a fresh
# HOME, running as nobody when run as root (root's is /etc/pki/libnbd).
#
# Peers take turns within each round, starting one later each round, so a
# burst of load from elsewhere touches all of them. Prints a markdown table
# per set: each peer's median figure (IOPS, or MiB/s for 1M rows), the
# spread (min-max over the rounds) and nbdmapper's ratio to the best peer.
# Results land in bench/results/.
#
# Environment:
#   FILL=written|sparse  the backing file: fully written (default), or a
#                        fresh sparse file with nothing allocated
#   ROWS="0 5"           run only these workloads (indices in the list below)
#   PEERS="..."          the peers, in first-round order (default: nbdmapper
#                        nbdkit qemu-nbd); nbdmapper-nomap is nbdmapper with
#                        --hole-map=false, the same binary without sparse reads
#   PROFILE=1            nbdmapper writes a CPU profile per round to
#                        bench/results/.../nbdmapper-ROUND.prof (the binary
#                        is kept beside them for go tool pprof)
set -euo pipefail
cd "$(dirname "$0")/.."
size_mib=${1:-1024}
runtime=${2:-10}
rounds=${3:-3}
sets=${4:-plain tls}

. bench/lib.sh
bench_setup peers fio nbdkit qemu-nbd python3 go openssl
disk=$work/disk.img
fill=${FILL:-written}
case $fill in
written)
	# A fully allocated file, so no peer pays for allocating holes during the run.
	fallocate -l "${size_mib}M" "$disk"
	dd if=/dev/urandom of="$disk" bs=1M count="$size_mib" conv=notrunc status=none
	;;
sparse) truncate -s "${size_mib}M" "$disk" ;;
*)
	echo "bench/peers.sh: FILL must be written or sparse" >&2
	exit 1
	;;
esac
sectors=$((size_mib * 2048))
echo "0 $sectors linear $disk 0" >"$work/one.table"

start_peer() { # name socket
	local name=$1 sock=$2
	case $name in
	nbdmapper) "$work/nbdmapper" serve --metrics off --control off ${PROFILE:+--cpuprofile "$out/$name-$round.prof"} \
		--socket "$sock" "bench=$work/one.table" 2>"$out/$name.log" & ;;
	nbdmapper-nomap) "$work/nbdmapper" serve --metrics off --control off --hole-map=false --socket "$sock" "bench=$work/one.table" 2>"$out/$name.log" & ;;
	nbdkit) nbdkit --foreground --unix "$sock" --exportname bench file "$disk" 2>"$out/$name.log" & ;;
	qemu-nbd) qemu-nbd --format raw --socket "$sock" --export-name bench --shared 8 --persistent \
		--cache writeback --aio threads "$disk" 2>"$out/$name.log" & ;;
	esac
	peer_pid=$!
	wait_socket "$sock" "$peer_pid" "$out/$name.log"
}

# make_pki DIR: a CA, a server certificate for localhost/127.0.0.1 and a
# client certificate, in the layout libnbd, nbdkit and qemu read
# (ca-cert.pem, server-cert.pem, server-key.pem, client-cert.pem, client-key.pem).
make_pki() {
	local d=$1 who
	mkdir -p "$d"
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
		-subj /CN=bench-ca -keyout "$d/ca-key.pem" -out "$d/ca-cert.pem" 2>/dev/null
	for who in server client; do
		openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$who" \
			-keyout "$d/$who-key.pem" -out "$d/$who.csr" 2>/dev/null
		if [ $who = server ]; then
			printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >"$d/$who.ext"
		else
			printf 'extendedKeyUsage=clientAuth\n' >"$d/$who.ext"
		fi
		openssl x509 -req -in "$d/$who.csr" -CA "$d/ca-cert.pem" -CAkey "$d/ca-key.pem" -CAcreateserial \
			-days 2 -extfile "$d/$who.ext" -out "$d/$who-cert.pem" 2>/dev/null
	done
}

# start_tls_peer NAME PORT: the peer on 127.0.0.1:PORT requiring TLS with
# a client certificate.
start_tls_peer() {
	local name=$1 port=$2 p=$work/pki
	case $name in
	nbdmapper | nbdmapper-nomap)
		local map=true
		[ "$name" = nbdmapper ] || map=false
		"$work/nbdmapper" serve --metrics off --control off --hole-map=$map --listen "127.0.0.1:$port" --tls require \
			--tls-cert "$p/server-cert.pem" --tls-key "$p/server-key.pem" --tls-ca "$p/ca-cert.pem" \
			"bench=$work/one.table" 2>"$out/$name-tls.log" &
		;;
	nbdkit) nbdkit --foreground --ipaddr 127.0.0.1 --port "$port" --tls=require --tls-certificates "$p" \
		--tls-verify-peer --exportname bench file "$disk" 2>"$out/$name-tls.log" & ;;
	qemu-nbd) qemu-nbd --format raw --bind 127.0.0.1 --port "$port" --export-name bench --shared 8 --persistent \
		--cache writeback --aio threads --object "tls-creds-x509,id=tls0,endpoint=server,dir=$p,verify-peer=on" \
		--tls-creds tls0 "$disk" 2>"$out/$name-tls.log" & ;;
	esac
	peer_pid=$!
	until nbdinfo --size "nbds://127.0.0.1:$port/bench?tls-certificates=$p" >/dev/null 2>&1; do
		if ! kill -0 "$peer_pid" 2>/dev/null; then
			echo "$name did not start:" >&2
			cat "$out/$name-tls.log" >&2
			exit 1
		fi
		sleep 0.05
	done
}

# fio_tls ARGS...: fio with libnbd's default certificate directory holding
# the client certificate (see the header).
fio_tls() {
	local home=$work/home
	if [ ! -d "$home" ]; then
		mkdir -p "$home/.pki/libnbd"
		cp "$work/pki/ca-cert.pem" "$work/pki/client-cert.pem" "$work/pki/client-key.pem" "$home/.pki/libnbd/"
		if [ "$(id -u)" = 0 ]; then
			chmod 711 "$work"
			chown -R nobody "$home"
		fi
	fi
	if [ "$(id -u)" = 0 ]; then
		(cd "$home" && HOME=$home setpriv --reuid=nobody --regid=nogroup --clear-groups fio "$@")
	else
		HOME=$home fio "$@"
	fi
}

# name | fio args
workloads=(
	"4k randread qd32|--rw=randread --bs=4k --iodepth=32"
	"4k randwrite qd32|--rw=randwrite --bs=4k --iodepth=32"
	"1M read qd8|--rw=read --bs=1M --iodepth=8"
	"1M write qd8|--rw=write --bs=1M --iodepth=8"
	"4k randwrite fsync=1|--rw=randwrite --bs=4k --iodepth=1 --fsync=1"
	"4k randread 4 conns|--rw=randread --bs=4k --iodepth=8 --numjobs=4"
)
read -r -a peers <<<"${PEERS:-nbdmapper nbdkit qemu-nbd}"
[ -z "${PROFILE:-}" ] || cp "$work/nbdmapper" "$out/nbdmapper"
read -r -a rows <<<"${ROWS:-${!workloads[*]}}"
[[ " $sets " != *" tls "* ]] || make_pki "$work/pki"
port=$((20000 + RANDOM % 20000))

for round in $(seq "$rounds"); do
	for set in $sets; do
		for k in "${!peers[@]}"; do
			peer=${peers[$(((k + round - 1) % ${#peers[@]}))]}
			if [ "$set" = tls ]; then
				port=$((port + 1))
				start_tls_peer "$peer" "$port"
				uri="nbds://127.0.0.1:$port/bench"
				run=fio_tls
			else
				sock=$work/$peer.sock
				rm -f "$sock"
				start_peer "$peer" "$sock"
				uri="nbd+unix:///bench?socket=$sock"
				run=fio
			fi
			for i in "${rows[@]}"; do
				args=${workloads[$i]#*|}
				# shellcheck disable=SC2086
				$run --name=w$i --ioengine=nbd "--uri=$uri" $args \
					--size="${size_mib}M" --time_based --runtime="$runtime" --ramp_time=1 \
					--group_reporting --output-format=json >"$out/$set-$peer-$i-$round.json"
			done
			kill -INT "$peer_pid"
			wait "$peer_pid" || true
		done
	done
done

printf '%s\n' "${workloads[@]%%|*}" >"$out/names"
echo "${rows[*]}" >"$out/rows"
{
	echo "machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), Linux $(uname -r), $(df -T "$work" | awk 'NR==2 {print $2}') under the files, file $fill"
	echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out/machine"
for set in $sets; do
	echo
	echo "$set:"
	python3 - "$out" "$rounds" "$set" "${peers[@]}" <<'PY'
import json, statistics, sys
out, rounds, set_, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
names = open(f"{out}/names").read().splitlines()
rows = [int(i) for i in open(f"{out}/rows").read().split()]

def one(peer, i, r):
    text = open(f"{out}/{set_}-{peer}-{i}-{r}.json").read()
    job = json.loads(text[text.index("{"):])["jobs"][0]  # fio may print a line before the JSON
    side = job["read"] if job["read"]["io_bytes"] else job["write"]
    if names[i].startswith("1M"):
        return side["bw_bytes"] / 2**20
    return side["iops"]

def figure(peer, i):
    unit = "MiB/s" if names[i].startswith("1M") else "IOPS"
    runs = [one(peer, i, r) for r in range(1, rounds + 1)]
    return statistics.median(runs), min(runs), max(runs), unit

print("| workload | unit | " + " | ".join(f"{p} (min-max)" for p in peers) + " | nbdmapper / best peer |")
print("|---|---|" + "---|" * len(peers) + "---|")
for i in rows:
    name = names[i]
    vals = {p: figure(p, i) for p in peers}
    unit = vals[peers[0]][3]
    others = [vals[p][0] for p in peers if not p.startswith("nbdmapper")]
    best = max(others) if others else 0
    ratio = vals["nbdmapper"][0] / best if best and "nbdmapper" in vals else float("nan")
    cells = " | ".join(f"{v[0]:.0f} ({v[1]:.0f}-{v[2]:.0f})" for v in vals.values())
    print(f"| {name} | {unit} | {cells} | {ratio:.2f} |")
PY
done | tee "$out/table.md"

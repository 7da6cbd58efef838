#!/usr/bin/env bash
# Serves a backing file through nbdmapper, nbdkit (file plugin) and qemu-nbd
# and runs the same fio nbd-engine workloads against each, in one run, so the
# ratios are measured under the same machine load.
#
#   bench/peers.sh [SIZE_MIB] [RUNTIME_S] [ROUNDS] [SETS] [STATES]
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
# STATES is "written sparse" by default: the state of the file each row
# starts from. written: every byte written (a synced copy of one random
# file made at the start); sparse: a fresh file with no blocks at all, as a
# new VM image is. Every row of every peer starts a fresh server on a fresh
# file in its state, so that no run inherits what another left behind: not
# another peer's writes or trims, and not its own earlier rows' page cache or
# write-back (on a sparse file, a peer that reads holes through the page
# cache leaves zero pages that its write rows then skip allocating; one that
# answers them as hole chunks leaves none). Each row runs for every peer
# before the next row starts.
#
# Every peer does the same work for each request: qemu-nbd runs with
# --discard=unmap, since by default it answers a trim without passing it to
# the file (nbdmapper and nbdkit's file plugin punch a hole for each).
#
# The order of the peers rotates every round, so a burst of load from
# elsewhere, or the page cache one peer leaves behind, touches each of them
# in turn. Besides each row's figure, the server's CPU time (user + system,
# from /proc/PID/stat) over the row's run is divided by the requests fio
# completed: CPU seconds per million requests. Prints the machine, then a
# markdown table per set and state: each peer's median figure (IOPS, or
# MiB/s for 1M rows), its median CPU per request, and nbdmapper's ratios to
# the best other peer (throughput: higher is better; CPU: lower is better).
#
# A VM whose balloon takes back guest memory that has lain free for 2 s
# (free page reporting) makes whichever server runs next pay for touching
# it again, and slows the first 1M write run of a row on a sparse file
# (docs/decisions/bench-method.md has the figures). So the run turns free page reporting off, and puts it
# back at exit (keep_free_memory in bench/lib.sh), and each row of each
# round starts with a run that is not measured, for memory the host took
# before the run: the round's first peer on a fresh file for WARMUP
# seconds (default: the runtime; 0 skips it).
#
# The last column is fio's own CPU per job (user + system, as fio reports
# it: per cent of each job's run time) against each peer. A job near 100%
# was busy all along, so the row measured the client as much as the
# server: fio's nbd engine runs each job in one thread, and libnbd makes
# the same system calls for each reply whichever server sends it (for a
# 4k read of a hole: a poll and three recvs, and a send for the request),
# so no server can raise such a row's figure by more than the time fio
# spent waiting for it.
#
# The ratio of medians alone cannot tell a difference between servers from
# the machine's drift, which moves a row by 10-30% between runs minutes
# apart: on a row where both servers meet the same ceiling (the page cache,
# AES, the disk's syncs) it falls either side of 1.0 by chance. So each row
# also has nbdmapper's ratio to the best other peer in each round, the two
# measured back to back, and a verdict from their signs: "ahead" when
# nbdmapper led in every round, "behind" when it trailed in every round,
# "level" otherwise. With 5 rounds a server that is no faster than the other
# is called ahead (or behind) by chance once in 32 rows; with 3, once in 8.
#
# PROFILE=1 also writes a Go CPU profile of each nbdmapper run to
# bench/results/.../nbdmapper-SET-STATE-ROW-ROUND.pprof.
#
# PEERS="..." picks the peers (default: nbdmapper nbdkit qemu-nbd); the
# peer nbdmapper-nomap is the same binary with --hole-map=false, which reads
# holes as data, as before sparse reads (a baseline for them in the same
# run), nbdmapper-nosplice the same binary with --splice=false, which
# reads every request into a buffer, and nbdmapper-pN the same binary with
# --procs=N instead of the default auto. ROWS="0 1" runs only those workloads (indices in the list below).
# Results land in bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
size_mib=${1:-1024}
runtime=${2:-10}
rounds=${3:-3}
sets=${4:-plain tls}
states=${5:-written sparse}
warmup=${WARMUP:-$runtime}

. bench/lib.sh
bench_setup peers fio nbdkit qemu-nbd python3 go openssl
bench_machine | tee "$out/machine.md"
keep_free_memory
template=$work/written.img
if [[ " $states " == *" written "* ]]; then
	dd if=/dev/urandom of="$template" bs=1M count="$size_mib" status=none
fi
sectors=$((size_mib * 2048))

# fresh_disk STATE PEER: a new backing file for PEER in STATE; prints its
# path. A written copy is synced, so that its write-back does not run
# under the peer's write and fsync rows.
fresh_disk() {
	local disk=$work/$2.img
	rm -f "$disk"
	case $1 in
	written) cp "$template" "$disk" && sync "$disk" ;;
	sparse) truncate -s "${size_mib}M" "$disk" ;;
	esac
	echo "$disk"
}

# profile_flag SET STATE ROW ROUND: nbdmapper's --cpuprofile, when PROFILE=1.
profile_flag() {
	[ "${PROFILE:-0}" = 1 ] && echo "--cpuprofile=$PWD/$out/nbdmapper-$1-$2-$3-$4.pprof"
	return 0
}

# variant_flag PEER: the flag that makes an nbdmapper-* variant PEER.
variant_flag() {
	case $1 in
	nbdmapper-nomap) echo --hole-map=false ;;
	nbdmapper-nosplice) echo --splice=false ;;
	nbdmapper-p[0-9]*) echo "--procs=${1#nbdmapper-p}" ;;
	*) echo --hole-map=true ;;
	esac
}

start_peer() { # name socket disk profile-flag
	local name=$1 sock=$2 disk=$3
	case $name in
	nbdmapper | nbdmapper-*)
		echo "0 $sectors linear $disk 0" >"$work/bench.table"
		"$work/nbdmapper" serve --metrics off --control off --socket "$sock" "$(variant_flag "$name")" $4 "bench=$work/bench.table" 2>"$out/$name.log" &
		;;
	nbdkit) nbdkit --foreground --unix "$sock" --exportname bench file "$disk" 2>"$out/$name.log" & ;;
	qemu-nbd) qemu-nbd --format raw --socket "$sock" --export-name bench --shared 8 --persistent \
		--cache writeback --aio threads --discard=unmap "$disk" 2>"$out/$name.log" & ;;
	esac
	peer_pid=$!
	wait_socket "$sock" "$peer_pid" "$out/$name.log"
}

# start_tls_peer NAME PORT DISK PROFILE-FLAG: the peer on 127.0.0.1:PORT
# requiring TLS with a client certificate.
start_tls_peer() {
	local name=$1 port=$2 disk=$3 p=$work/pki
	case $name in
	nbdmapper | nbdmapper-*)
		echo "0 $sectors linear $disk 0" >"$work/bench.table"
		"$work/nbdmapper" serve --metrics off --control off --listen "127.0.0.1:$port" "$(variant_flag "$name")" --tls require \
			--tls-cert "$p/server-cert.pem" --tls-key "$p/server-key.pem" --tls-ca "$p/ca-cert.pem" $4 \
			"bench=$work/bench.table" 2>"$out/$name-tls.log" &
		;;
	nbdkit) nbdkit --foreground --ipaddr 127.0.0.1 --port "$port" --tls=require --tls-certificates "$p" \
		--tls-verify-peer --exportname bench file "$disk" 2>"$out/$name-tls.log" & ;;
	qemu-nbd) qemu-nbd --format raw --bind 127.0.0.1 --port "$port" --export-name bench --shared 8 --persistent \
		--cache writeback --aio threads --discard=unmap --object "tls-creds-x509,id=tls0,endpoint=server,dir=$p,verify-peer=on" \
		--tls-creds tls0 "$disk" 2>"$out/$name-tls.log" & ;;
	esac
	peer_pid=$!
	wait_tls "$port" "$peer_pid" "$out/$name-tls.log"
}

# name | fio args. Reads before writes before trims (see the header).
workloads=(
	"4k randread qd32|--rw=randread --bs=4k --iodepth=32"
	"4k randread 4 conns|--rw=randread --bs=4k --iodepth=8 --numjobs=4"
	"1M read qd8|--rw=read --bs=1M --iodepth=8"
	"4k randwrite qd32|--rw=randwrite --bs=4k --iodepth=32"
	"1M write qd8|--rw=write --bs=1M --iodepth=8"
	"4k randwrite fsync=1|--rw=randwrite --bs=4k --iodepth=1 --fsync=1"
	"1M trim qd8|--rw=trim --bs=1M --iodepth=8"
)
read -r -a peers <<<"${PEERS:-nbdmapper nbdkit qemu-nbd}"
read -r -a rows <<<"${ROWS:-${!workloads[*]}}"
[[ " $sets " != *" tls "* ]] || make_pki "$work/pki"
port=$((20000 + RANDOM % 20000))

# run_row ROUND SET STATE ROW PEER [SECONDS]: workload ROW against PEER,
# freshly started on a fresh file in STATE, with the server's CPU time
# around it; given SECONDS, a warm-up of that long, kept apart from the
# measured runs.
run_row() {
	local round=$1 set=$2 state=$3 i=$4 peer=$5 disk prof="" uri run base args
	local secs=${6:-$runtime} tag=${6:+warmup-}
	disk=$(fresh_disk "$state" "$peer")
	[ "$peer" = nbdmapper ] && [ -z "$tag" ] && prof=$(profile_flag "$set" "$state" "$i" "$round")
	if [ "$set" = tls ]; then
		port=$((port + 1))
		start_tls_peer "$peer" "$port" "$disk" "$prof"
		uri="nbds://127.0.0.1:$port/bench"
		run=fio_tls
	else
		local sock=$work/$peer.sock
		rm -f "$sock"
		start_peer "$peer" "$sock" "$disk" "$prof"
		uri="nbd+unix:///bench?socket=$sock"
		run=fio
	fi
	args=${workloads[$i]#*|}
	base=$out/$tag$set-$state-$peer-$i-$round
	cpu_ticks "$peer_pid" >"$base.cpu0"
	# shellcheck disable=SC2086
	$run --name=w$i --ioengine=nbd "--uri=$uri" $args \
		--size="${size_mib}M" --time_based --runtime="$secs" \
		--group_reporting --output-format=json >"$base.json"
	cpu_ticks "$peer_pid" >"$base.cpu1"
	kill -INT "$peer_pid"
	wait "$peer_pid" || true
	# The file's dirty pages go with it; sync waits for the journal commit
	# that frees its blocks (and, with online discard, discards them).
	rm -f "$disk"
	sync -f "$work"
}

for round in $(seq "$rounds"); do
	# Rotate: round 1 starts with nbdmapper, round 2 with nbdkit, ...
	order=("${peers[@]:$(((round - 1) % ${#peers[@]}))}" "${peers[@]:0:$(((round - 1) % ${#peers[@]}))}")
	for set in $sets; do
		for state in $states; do
			for i in "${rows[@]}"; do
				[ "$warmup" = 0 ] || run_row "$round" "$set" "$state" "$i" "${order[0]}" "$warmup"
				for peer in "${order[@]}"; do
					run_row "$round" "$set" "$state" "$i" "$peer"
				done
			done
		done
	done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.md"

printf '%s\n' "${workloads[@]%%|*}" >"$out/names"
echo "${rows[*]}" >"$out/rows"
for set in $sets; do
	for state in $states; do
		echo
		echo "$set, $state file:"
		python3 - "$out" "$rounds" "$set" "$state" "$(getconf CLK_TCK)" "${peers[@]}" <<'PY'
import json, statistics, sys
out, rounds, set_, state, hz, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6:]
names = open(f"{out}/names").read().splitlines()
rows = [int(i) for i in open(f"{out}/rows").read().split()]

def one(peer, i, r):
    base = f"{out}/{set_}-{state}-{peer}-{i}-{r}"
    text = open(f"{base}.json").read()
    job = json.loads(text[text.index("{"):])["jobs"][0]  # fio may print a line before the JSON
    side = max((job[k] for k in ("read", "write", "trim")), key=lambda s: s["io_bytes"])
    ios = sum(job[k]["total_ios"] for k in ("read", "write", "trim", "sync"))
    ticks = int(open(f"{base}.cpu1").read()) - int(open(f"{base}.cpu0").read())
    cpu = ticks / hz / ios * 1e6 if ios else float("nan")
    fig = side["bw_bytes"] / 2**20 if names[i].startswith("1M") else side["iops"]
    return fig, cpu, job["usr_cpu"] + job["sys_cpu"]

def verdict(ratios, better):
    """ahead, behind or level, from the rounds' ratios; better(r) says r favours nbdmapper."""
    if all(better(r) for r in ratios):
        return "ahead"
    if not any(better(r) or r == 1 for r in ratios):
        return "behind"
    return "level"

print("| workload | unit | " + " | ".join(peers) + " | nbdmapper / best | by round | verdict | CPU s per M requests: " + " / ".join(peers) + " | CPU nbdmapper / best | by round | verdict | fio CPU %: " + " / ".join(peers) + " |")
print("|---|---|" + "---|" * len(peers) + "---|---|---|---|---|---|---|---|")
for i in rows:
    name = names[i]
    runs = {p: [one(p, i, r) for r in range(1, rounds + 1)] for p in peers}
    vals = {p: tuple(statistics.median(x[k] for x in rs) for k in range(3)) for p, rs in runs.items()}
    unit = "MiB/s" if name.startswith("1M") else "IOPS"
    others = [p for p in peers if not p.startswith("nbdmapper")]
    cells = " | ".join(f"{vals[p][0]:.0f}" for p in peers)
    cpus = " / ".join(f"{vals[p][1]:.1f}" for p in peers)
    client = " / ".join(f"{vals[p][2]:.0f}" for p in peers)
    if not others:  # PEERS=nbdmapper, for a profile: no ratios
        print(f"| {name} | {unit} | {cells} | | | | {cpus} | | | | {client} |")
        continue
    best = max(vals[p][0] for p in others)
    cheapest = min(vals[p][1] for p in others)
    ratio, cpu_ratio = vals["nbdmapper"][0] / best, vals["nbdmapper"][1] / cheapest
    # Round r: nbdmapper against the best (the cheapest) other peer of that round.
    by = [runs["nbdmapper"][r][0] / max(runs[p][r][0] for p in others) for r in range(rounds)]
    cpu_by = [runs["nbdmapper"][r][1] / min(runs[p][r][1] for p in others) for r in range(rounds)]
    fmt = lambda rs: " ".join(f"{r:.2f}" for r in rs)
    print(f"| {name} | {unit} | {cells} | {ratio:.2f} | {fmt(by)} | {verdict(by, lambda r: r > 1)} "
          f"| {cpus} | {cpu_ratio:.2f} | {fmt(cpu_by)} | {verdict(cpu_by, lambda r: r < 1)} | {client} |")
PY
	done
done | tee "$out/table.md"

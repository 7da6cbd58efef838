#!/usr/bin/env bash
# Serves one backing file through nbdmapper, nbdkit (file plugin) and qemu-nbd
# and runs the same fio nbd-engine workloads against each, in one run, so the
# ratios are measured under the same machine load.
#
#   bench/peers.sh [SIZE_MIB] [RUNTIME_S] [ROUNDS]
#
# Peers take turns within each round, so a burst of load from elsewhere
# touches all of them. Prints a markdown table: each peer's median figure
# (IOPS, or MiB/s for 1M rows) and nbdmapper's ratio to the best peer.
# Results land in bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
size_mib=${1:-1024}
runtime=${2:-10}
rounds=${3:-3}

. bench/lib.sh
bench_setup peers fio nbdkit qemu-nbd python3 go
disk=$work/disk.img
# A fully allocated file, so no peer pays for allocating holes during the run.
fallocate -l "${size_mib}M" "$disk"
dd if=/dev/urandom of="$disk" bs=1M count="$size_mib" conv=notrunc status=none
sectors=$((size_mib * 2048))
echo "0 $sectors linear $disk 0" >"$work/one.table"

start_peer() { # name socket
	local name=$1 sock=$2
	case $name in
	nbdmapper) "$work/nbdmapper" serve --metrics off --socket "$sock" "bench=$work/one.table" 2>"$out/$name.log" & ;;
	nbdkit) nbdkit --foreground --unix "$sock" --exportname bench file "$disk" 2>"$out/$name.log" & ;;
	qemu-nbd) qemu-nbd --format raw --socket "$sock" --export-name bench --shared 8 --persistent \
		--cache writeback --aio threads "$disk" 2>"$out/$name.log" & ;;
	esac
	peer_pid=$!
	wait_socket "$sock" "$peer_pid" "$out/$name.log"
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
peers=(nbdmapper nbdkit qemu-nbd)

for round in $(seq "$rounds"); do
	for peer in "${peers[@]}"; do
		sock=$work/$peer.sock
		rm -f "$sock"
		start_peer "$peer" "$sock"
		for i in "${!workloads[@]}"; do
			args=${workloads[$i]#*|}
			# shellcheck disable=SC2086
			fio --name=w$i --ioengine=nbd "--uri=nbd+unix:///bench?socket=$sock" $args \
				--size="${size_mib}M" --time_based --runtime="$runtime" --ramp_time=1 \
				--group_reporting --output-format=json --output="$out/$peer-$i-$round.json" >/dev/null
		done
		kill -INT "$peer_pid"
		wait "$peer_pid" || true
	done
done

printf '%s\n' "${workloads[@]%%|*}" >"$out/names"
python3 - "$out" "$rounds" "${peers[@]}" <<'PY' | tee "$out/table.md"
import json, statistics, sys
out, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
names = open(f"{out}/names").read().splitlines()

def one(peer, i, r):
    job = json.load(open(f"{out}/{peer}-{i}-{r}.json"))["jobs"][0]
    side = job["read"] if job["read"]["io_bytes"] else job["write"]
    if names[i].startswith("1M"):
        return side["bw_bytes"] / 2**20
    return side["iops"]

def figure(peer, i):
    unit = "MiB/s" if names[i].startswith("1M") else "IOPS"
    return statistics.median(one(peer, i, r) for r in range(1, rounds + 1)), unit

print("| workload | unit | " + " | ".join(peers) + " | nbdmapper / best peer |")
print("|---|---|" + "---|" * len(peers) + "---|")
for i, name in enumerate(names):
    vals = {p: figure(p, i) for p in peers}
    unit = vals[peers[0]][1]
    best = max(vals[p][0] for p in peers if p != "nbdmapper")
    ratio = vals["nbdmapper"][0] / best if best else float("nan")
    cells = " | ".join(f"{vals[p][0]:.0f}" for p in peers)
    print(f"| {name} | {unit} | {cells} | {ratio:.2f} |")
PY

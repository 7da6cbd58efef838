#!/usr/bin/env bash
# How close the servers' 1M writes come to the page cache's own ceiling: in
# one run, rotated every round, on a fresh file in each state,
#
#   file        fio writing the file itself, one psync thread per CPU, each
#               writing its own slice of the file in 1 MiB writes: what the
#               page cache and write-back take from the machine, with no
#               server and no socket in the way (one thread gets less: its
#               writes wait on dirty-page throttling with a CPU idle)
#   nbdmapper   peers.sh's "1M write qd8" row, through nbdmapper
#   nbdkit      the same row through nbdkit's file plugin
#
# Each row's figure is MiB/s, and CPU µs per MiB: the writers' own for
# "file" (fio's user + system time), the server's for the others (fio's is
# the client's, the same work for both servers).
#
#   [NBDMAPPER_BIN=...] bench/ceiling.sh [SIZE_MIB] [RUNTIME_S] [ROUNDS] [STATES]
#   defaults: 1024, 5, 3, "written sparse"
set -euo pipefail
size_mib=${1:-1024}
runtime=${2:-5}
rounds=${3:-3}
states=${4:-written sparse}

. bench/lib.sh
bench_setup ceiling fio nbdkit python3 go
bench_machine | tee "$out/machine.md"
template=$work/written.img
[[ " $states " != *" written "* ]] || dd if=/dev/urandom of="$template" bs=1M count="$size_mib" status=none
sectors=$((size_mib * 2048))
peers=(file nbdmapper nbdkit)

# run_one ROUND STATE PEER: PEER's 1 MiB writes for RUNTIME seconds on a
# fresh file in STATE; its fio JSON and CPU ticks go to $out.
run_one() {
	local base=$out/$2-$3-$1 disk=$work/disk.img sock=$work/peer.sock pid
	rm -f "$disk" "$sock"
	case $2 in
	written) cp "$template" "$disk" && sync "$disk" ;;
	sparse) truncate -s "${size_mib}M" "$disk" ;;
	esac
	local job=(--name=w --rw=write --bs=1M --size="${size_mib}M" --time_based
		--runtime="$runtime" --output-format=json)
	case $3 in
	file)
		local n
		n=$(nproc)
		# bash's time: user and system seconds of fio and the job
		# processes it forks and waits for.
		echo 0 >"$base.cpu0"
		{ TIMEFORMAT='%U %S' && time fio "${job[@]}" --ioengine=psync --filename="$disk" \
			--numjobs="$n" --size="$((size_mib / n))M" --offset_increment="$((size_mib / n))M" \
			--group_reporting >"$base.json"; } 2>"$base.time"
		awk -v hz="$(getconf CLK_TCK)" '{printf "%d\n", ($1 + $2) * hz}' "$base.time" >"$base.cpu1"
		;;
	*)
		if [ "$3" = nbdmapper ]; then
			echo "0 $sectors linear $disk 0" >"$work/bench.table"
			"$work/nbdmapper" serve --metrics off --control off --socket "$sock" "bench=$work/bench.table" 2>"$out/$3.log" &
		else
			nbdkit --foreground --unix "$sock" --exportname bench file "$disk" 2>"$out/$3.log" &
		fi
		pid=$!
		wait_socket "$sock" "$pid" "$out/$3.log"
		cpu_ticks "$pid" >"$base.cpu0"
		fio "${job[@]}" --ioengine=nbd "--uri=nbd+unix:///bench?socket=$sock" --iodepth=8 >"$base.json"
		cpu_ticks "$pid" >"$base.cpu1"
		kill -INT "$pid"
		wait "$pid" || true
		;;
	esac
	rm -f "$disk"
	sync -f "$work"
}

for round in $(seq "$rounds"); do
	order=("${peers[@]:$(((round - 1) % 3))}" "${peers[@]:0:$(((round - 1) % 3))}")
	for state in $states; do
		for peer in "${order[@]}"; do
			run_one "$round" "$state" "$peer"
		done
	done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.md"

# shellcheck disable=SC2086 # one argument per state
python3 - "$out" "$rounds" "$(getconf CLK_TCK)" "${peers[@]}" -- $states <<'PY' | tee "$out/table.md"
import json, statistics, sys
out, rounds, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sep = sys.argv.index("--")
peers, states = sys.argv[4:sep], sys.argv[sep + 1:]

def one(state, peer, r):
    base = f"{out}/{state}-{peer}-{r}"
    text = open(f"{base}.json").read()
    job = json.loads(text[text.index("{"):])["jobs"][0]  # fio may print a line before the JSON
    mib = job["write"]["io_bytes"] / 2**20
    cpu = (int(open(f"{base}.cpu1").read()) - int(open(f"{base}.cpu0").read())) / hz
    return job["write"]["bw_bytes"] / 2**20, cpu / mib * 1e6

print("| state | " + " | ".join(f"{p} MiB/s (µs CPU per MiB)" for p in peers) + " | per round, MiB/s | nbdmapper / file | nbdkit / file |")
print("|---|" + "---|" * len(peers) + "---|---|---|")
for state in states:
    runs = {p: [one(state, p, r) for r in range(1, rounds + 1)] for p in peers}
    med = {p: (statistics.median(f for f, _ in runs[p]), statistics.median(c for _, c in runs[p])) for p in peers}
    cells = " | ".join(f"{med[p][0]:,.0f} ({med[p][1]:.0f})" for p in peers)
    spread = "; ".join(f"{p} " + "/".join(f"{f:,.0f}" for f, _ in runs[p]) for p in peers)
    print(f"| {state} | {cells} | {spread} | {med['nbdmapper'][0] / med['file'][0]:.2f} | {med['nbdkit'][0] / med['file'][0]:.2f} |")
PY

#!/usr/bin/env bash
# Runs one fio workload against several nbdmapper binaries (and nbdkit, as
# a reference), one after another in every round (the order rotating from
# round to round), each on a fresh synced copy of the same written file:
# what peers.sh does for servers, done for builds, so that two versions are
# compared under the same machine load.
#
#   bench/builds.sh "FIO ARGS" [ROUNDS] BINARY|nbdkit...
#
# e.g. bench/builds.sh "--rw=randwrite --bs=4k --iodepth=1 --fsync=1" 3 \
#          ./nbdmapper-old ./nbdmapper-new nbdkit
#
# Each nbdmapper serves a one-line linear table over a 1 GiB file on a unix
# socket (EXTRA="--procs=2" adds flags to every one; STATE=sparse serves a
# fresh sparse file instead of the written one; SET=tls serves on loopback
# TCP with TLS required and client certificates verified, as peers.sh's
# tls set does); fio's nbd engine runs RUNTIME seconds (default 5). Prints each run, then per binary the median
# IOPS, MiB/s, server CPU (user + system, from /proc) per request in µs,
# and the machine's CPU per request: every process but fio's (task_ticks
# in bench/lib.sh), so that work the server hands to kernel threads counts
# too; then each binary against the first, round by round.
# Free page reporting is off for the run (keep_free_memory in bench/lib.sh).
# Results land in bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
spec=$1
rounds=${2:-3}
shift 2
[ $# -gt 0 ] || { echo "usage: bench/builds.sh \"FIO ARGS\" ROUNDS BINARY|nbdkit..." >&2; exit 2; }
bins=()
for b in "$@"; do
	if [ "$b" = nbdkit ]; then bins+=(nbdkit); else bins+=("$(realpath "$b")"); fi
done

. bench/lib.sh
bench_setup builds fio nbdkit python3 openssl
bench_machine | tee "$out/machine.md"
echo "file: ${STATE:-written}, ${SET:-plain}" | tee -a "$out/machine.md"
keep_free_memory
[ "${SET:-plain}" != tls ] || make_pki "$work/pki"
port=$((20000 + RANDOM % 20000))
dd if=/dev/urandom of="$work/written.img" bs=1M count=1024 status=none
sync "$work/written.img" # not written back under the first runs
sock=$work/s
n=${#bins[@]}
for round in $(seq "$rounds"); do
	# Rotate: round 1 starts with the first binary, round 2 with the
	# second, ..., so that no binary always runs first.
	for k in $(seq 0 $((n - 1))); do
		i=$(((k + round - 1) % n))
		b=${bins[$i]}
		rm -f "$work/d.img"
		if [ "${STATE:-written}" = sparse ]; then
			truncate -s 1G "$work/d.img"
		else
			cp "$work/written.img" "$work/d.img"
		fi
		sync "$work/d.img"
		echo "0 2097152 linear $work/d.img 0" >"$work/t"
		rm -f "$sock"
		if [ "${SET:-plain}" = tls ]; then
			port=$((port + 1))
			p=$work/pki
			uri="nbds://127.0.0.1:$port/bench"
			run=fio_tls
			if [ "$b" = nbdkit ]; then
				nbdkit --foreground --ipaddr 127.0.0.1 --port "$port" --tls=require --tls-certificates "$p" \
					--tls-verify-peer --exportname bench file "$work/d.img" 2>"$out/$i.log" &
			else
				# shellcheck disable=SC2086
				"$b" serve --metrics off --control off --listen "127.0.0.1:$port" --tls require \
					--tls-cert "$p/server-cert.pem" --tls-key "$p/server-key.pem" --tls-ca "$p/ca-cert.pem" \
					${EXTRA:-} "bench=$work/t" 2>"$out/$i.log" &
			fi
			pid=$!
			wait_tls "$port" "$pid" "$out/$i.log"
		else
			uri="nbd+unix:///bench?socket=$sock"
			run=fio
			if [ "$b" = nbdkit ]; then
				nbdkit --foreground --unix "$sock" --exportname bench file "$work/d.img" 2>"$out/$i.log" &
			else
				# shellcheck disable=SC2086
				"$b" serve --metrics off --control off --socket "$sock" ${EXTRA:-} "bench=$work/t" 2>"$out/$i.log" &
			fi
			pid=$!
			wait_socket "$sock" "$pid" "$out/$i.log"
		fi
		base=$out/$i-$round
		cpu_ticks "$pid" >"$base.cpu0"
		task_ticks >"$base.all0"
		# shellcheck disable=SC2086
		$run --name=b --ioengine=nbd "--uri=$uri" $spec --size=1024M \
			--time_based --runtime="${RUNTIME:-5}" --output-format=json >"$base.json"
		cpu_ticks "$pid" >"$base.cpu1"
		task_ticks >"$base.all1"
		kill -INT "$pid"
		wait "$pid" || true
	done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.md"
python3 - "$out" "$rounds" "$(getconf CLK_TCK)" "${bins[@]}" <<'PY' | tee "$out/table.md"
import json, statistics, sys
out, rounds, hz, bins = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def tasks(path):
    return dict(map(int, line.split()) for line in open(path))
print("| binary | IOPS | MiB/s | CPU µs per request | machine CPU µs per request |")
print("|---|---|---|---|---|")
every = []
for i, b in enumerate(bins):
    runs = []
    for r in range(1, rounds + 1):
        base = f"{out}/{i}-{r}"
        text = open(f"{base}.json").read()
        job = json.loads(text[text.index("{"):])["jobs"][0]
        side = max((job[k] for k in ("read", "write", "trim")), key=lambda s: s["io_bytes"])
        ios = sum(job[k]["total_ios"] for k in ("read", "write", "trim", "sync"))
        ticks = int(open(f"{base}.cpu1").read()) - int(open(f"{base}.cpu0").read())
        t0, t1 = tasks(f"{base}.all0"), tasks(f"{base}.all1")
        machine = sum(v - t0.get(t, 0) for t, v in t1.items())
        runs.append((side["iops"], side["bw_bytes"] / 2**20, ticks / hz / ios * 1e6, machine / hz / ios * 1e6))
        print(f"  round {r} {b.split('/')[-1]}: {runs[-1][0]:.0f} IOPS, {runs[-1][1]:.0f} MiB/s, {runs[-1][2]:.2f} µs, machine {runs[-1][3]:.2f} µs", file=sys.stderr)
    med = [statistics.median(x[k] for x in runs) for k in range(4)]
    print(f"| {b.split('/')[-1]} | {med[0]:.0f} | {med[1]:.0f} | {med[2]:.2f} | {med[3]:.2f} |")
    every.append(runs)
# Paired: each binary against the first in the same round, which ran
# under the same machine load, so that a slow minute of a shared host
# drops both sides of a ratio rather than one side of a median.
print()
print(f"| binary / {bins[0].split('/')[-1]} | IOPS, median of rounds | rounds with more IOPS | CPU per request, median of rounds |")
print("|---|---|---|---|")
for b, runs in zip(bins[1:], every[1:]):
    iops = [x[0] / y[0] for x, y in zip(runs, every[0])]
    cpu = [x[2] / y[2] for x, y in zip(runs, every[0])]
    print(f"| {b.split('/')[-1]} | {statistics.median(iops):.3f} | {sum(r > 1 for r in iops)} of {rounds} | {statistics.median(cpu):.3f} |")
PY

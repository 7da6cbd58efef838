#!/usr/bin/env bash
# Many clients for long: CONNS fio nbd-engine connections at queue depth
# QD, 4k random reads and writes (70/30) over a fully written file, for
# SECONDS, against one nbdmapper. Reports throughput per interval (is it
# steady, or does it decay?), fio's p99 and p99.9 completion latency, and
# the server's RSS sampled every interval (is it flat?).
#
#   bench/longrun.sh [CONNS [QD [SECONDS [INTERVAL_S [SIZE_MIB]]]]]
#                    defaults: 64 32 600 30 1024
#
# Prints a markdown table (interval, MiB/s, IOPS, server RSS) and a
# summary: the last interval's IOPS over the first's, the spread, RSS at
# the start and its peak. Results land in bench/results/longrun-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
conns=${1:-64}
qd=${2:-32}
seconds=${3:-600}
interval=${4:-30}
size_mib=${5:-1024}

. bench/lib.sh
bench_setup longrun fio python3 go
bench_machine >"$out/machine.md"
disk=$work/disk.img
dd if=/dev/urandom of="$disk" bs=1M count="$size_mib" status=none
echo "0 $((size_mib * 2048)) linear $disk 0" >"$work/bench.table"
sock=$work/nbd.sock
"$work/nbdmapper" serve --metrics off --control off --socket "$sock" "bench=$work/bench.table" 2>"$out/serve.log" &
pid=$!
wait_socket "$sock" "$pid" "$out/serve.log"

rss() { awk '/VmRSS/ {print $2}' "/proc/$pid/status"; }
rss >"$out/rss"
(
	while kill -0 "$pid" 2>/dev/null; do
		sleep "$interval"
		rss >>"$out/rss" 2>/dev/null || break
	done
) &
sampler=$!
fio --name=long --ioengine=nbd "--uri=nbd+unix:///bench?socket=$sock" \
	--rw=randrw --rwmixread=70 --bs=4k --iodepth="$qd" --numjobs="$conns" \
	--size="${size_mib}M" --time_based --runtime="$seconds" --group_reporting \
	--percentile_list=50:99:99.9 \
	--write_iops_log="$out/iops" --log_avg_msec=$((interval * 1000)) \
	--output-format=json --output="$out/fio.json"
kill "$sampler" 2>/dev/null || true
kill -INT "$pid"
wait "$pid" || true

python3 - "$out" "$interval" <<'PY' | tee "$out/table.md"
import glob, json, statistics, sys
out, interval = sys.argv[1], int(sys.argv[2])
# fio writes one IOPS log per job and direction: time (ms), IOPS, dir, ...
per, logs = {}, {}
for f in glob.glob(f"{out}/iops_iops.*.log"):
    for line in open(f):
        t, v = line.split(",")[:2]
        k = round(int(t) / 1000 / interval)
        per[k] = per.get(k, 0) + int(v)
        logs[k] = logs.get(k, 0) + 1
# An interval that not every job's log reached (the last one, cut short
# when the jobs stop one by one) is not a whole interval.
full = max(logs.values(), default=0)
per = {k: v for k, v in per.items() if logs[k] == full}
rss = [int(x) for x in open(f"{out}/rss").read().split()]
text = open(f"{out}/fio.json").read()
job = json.loads(text[text.index("{"):])["jobs"][0]
print(open(f"{out}/machine.md").read())
print("| interval | IOPS | MiB/s | server RSS (MiB) |")
print("|---:|---:|---:|---:|")
keys = sorted(k for k in per if k > 0)
for i, k in enumerate(keys):
    r = rss[min(i + 1, len(rss) - 1)] / 1024
    print(f"| {k * interval} s | {per[k]:.0f} | {per[k] * 4 / 1024:.1f} | {r:.1f} |")
vals = [per[k] for k in keys]
print()
for side in ("read", "write"):
    p = job[side]["clat_ns"]["percentile"]
    print(f"- {side}: {job[side]['iops']:.0f} IOPS, completion latency p50 {p['50.000000'] / 1000:.0f} µs, "
          f"p99 {p['99.000000'] / 1000:.0f} µs, p99.9 {p['99.900000'] / 1000:.0f} µs")
if len(vals) >= 2:
    print(f"- last interval / first: {vals[-1] / vals[0]:.2f}; min / max over the run: {min(vals) / max(vals):.2f}; "
          f"coefficient of variation {statistics.pstdev(vals) / statistics.mean(vals):.3f}")
print(f"- server RSS: {rss[0] / 1024:.1f} MiB at the start, {max(rss) / 1024:.1f} MiB at peak, {rss[-1] / 1024:.1f} MiB at the end")
PY

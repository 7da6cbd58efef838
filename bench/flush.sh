#!/usr/bin/env bash
# The seed scenario of issue 3: device-mapper before Linux 6.11 sent one
# flush per target, so a table of 1024 linear segments on one disk turned
# every fsync into 1024 flushes of that disk. This serves, in one run:
#
#   one file:  1 segment          (reference)
#              1024 segments      8000 sectors each, 16384 sectors apart
#              1024 segments      with --flush-baseline=per-segment (old dm)
#   two files: 2 segments         one per file (reference)
#              1024 segments      512 per file, alternating
#              1024 segments      per-segment baseline
#
# and drives each with fio's nbd engine: 4k random writes, fsync=1 (a FLUSH
# after every write), iodepth 1, with 1 job and with 16 jobs (connections).
# Syncs per flush come from the server's "flush stats" log line at shutdown.
#
#   [FILL=written] bench/flush.sh [RUNTIME_S] [REPS] [JOBS...]   defaults: 10 s, 3, jobs 1 16
#
# Every run starts on freshly created sparse backing files, so that each case
# pays the same block allocation. Cases are interleaved REPS times and the
# table shows the median throughput; flushes and syncs are summed over reps.
# Prints a markdown table and leaves it with fio's JSON and the server logs
# in bench/results/flush-*/. The backing files are sparse (8 GiB apparent
# size); only the blocks fio writes take space.
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-10}
reps=${2:-3}
shift 2 || shift $# || true
if [ $# -gt 0 ]; then jobs_list=("$@"); else jobs_list=(1 16); fi

. bench/lib.sh
bench_setup flush fio python3 go

segs=1024 seglen=8000 stride=16384
total=$((segs * seglen))
one=$work/one.img
a=$work/a.img
b=$work/b.img
# FILL=written: write the backing files out once and keep them, so every
# case overwrites allocated blocks and the filesystem allocates nothing;
# this separates nbdmapper's cost from ext4's cost of allocating into a
# fragmented sparse file. Default (sparse): fresh sparse files every run.
fill=${FILL:-sparse}
fresh_files() {
	if [ "$fill" = written ]; then
		[ -f "$one" ] && return
		dd if=/dev/zero of="$one" bs=4M count=$((segs * stride * 512 / (4 << 20))) conv=fsync status=none
		dd if=/dev/zero of="$a" bs=4M count=$((segs / 2 * stride * 512 / (4 << 20))) conv=fsync status=none
		cp --sparse=never "$a" "$b" && sync "$b"
		return
	fi
	rm -f "$one" "$a" "$b"
	truncate -s $((segs * stride * 512)) "$one"
	truncate -s $((segs / 2 * stride * 512)) "$a" "$b"
}

echo "0 $total linear $one 0" >"$work/one-1.table"
echo "0 $((total / 2)) linear $a 0" >"$work/two-2.table"
echo "$((total / 2)) $((total / 2)) linear $b 0" >>"$work/two-2.table"
for ((i = 0; i < segs; i++)); do
	echo "$((i * seglen)) $seglen linear $one $((i * stride))"
done >"$work/one-1024.table"
for ((i = 0; i < segs; i++)); do
	f=$a
	((i % 2)) && f=$b
	echo "$((i * seglen)) $seglen linear $f $((i / 2 * stride))"
done >"$work/two-1024.table"

# name | table | serve flags
cases=(
	"one file, 1 segment|one-1|"
	"one file, 1024 segments|one-1024|"
	"one file, 1024 segments, per-segment flush (dm < 6.11)|one-1024|--flush-baseline=per-segment"
	"two files, 2 segments|two-2|"
	"two files, 1024 segments|two-1024|"
	"two files, 1024 segments, per-segment flush (dm < 6.11)|two-1024|--flush-baseline=per-segment"
)

: >"$out/runs"
for ((rep = 1; rep <= reps; rep++)); do
for jobs in "${jobs_list[@]}"; do
	for i in "${!cases[@]}"; do
		IFS='|' read -r name tab flags <<<"${cases[$i]}"
		id=$i-j$jobs-r$rep
		fresh_files
		sock=$work/$id.sock
		# shellcheck disable=SC2086
		"$work/nbdmapper" serve --metrics off --control off --socket "$sock" $flags "bench=$work/$tab.table" 2>"$out/$id.log" &
		pid=$!
		wait_socket "$sock" "$pid" "$out/$id.log"
		fio --name=flush --ioengine=nbd "--uri=nbd+unix:///bench?socket=$sock" \
			--rw=randwrite --bs=4k --iodepth=1 --fsync=1 --numjobs="$jobs" \
			--size=$((total * 512)) --time_based --runtime="$runtime" \
			--group_reporting --output-format=json --output="$out/$id.json" >/dev/null
		kill -INT "$pid"
		wait "$pid" || true
		printf '%s|%s|%s\n' "$id" "$jobs" "$name" >>"$out/runs"
	done
done
done

{
	echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), kernel $(uname -r)," \
		"filesystem $(df -T "$work" | awk 'NR==2 {print $2}'), $(fio --version), ${reps} x ${runtime}s per row, backing files $fill"
	echo
} >"$out/machine"
python3 - "$out" <<'PY' | tee "$out/table.md"
import json, re, statistics, sys
out = sys.argv[1]
print(open(f"{out}/machine").read(), end="")
rows = {}  # (jobs, name) -> [kib...], [iops...], flushes, syncs
for line in open(f"{out}/runs"):
    id_, jobs, name = line.rstrip("\n").split("|", 2)
    w = json.load(open(f"{out}/{id_}.json"))["jobs"][0]["write"]
    m = re.search(r'msg="flush stats" flushes=(\d+) syncs=(\d+)', open(f"{out}/{id_}.log").read())
    r = rows.setdefault((int(jobs), name), [[], [], 0, 0])
    r[0].append(w["bw_bytes"] / 1024)
    r[1].append(w["iops"])
    if m:
        r[2] += int(m[1])
        r[3] += int(m[2])
print("| case | jobs | IOPS | KiB/s | vs reference | flushes | syncs | syncs/flush |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
ref = None
for (jobs, name), (kib, iops, flushes, syncs) in sorted(rows.items(), key=lambda kv: kv[0][0]):
    kib, iops = statistics.median(kib), statistics.median(iops)
    if name.endswith("1 segment") or name.endswith("2 segments"):
        ref = kib
    ratio = f"{kib / ref:.3f}" if ref else "-"
    spf = f"{syncs / flushes:.3f}" if flushes else "-"
    print(f"| {name} | {jobs} | {iops:.0f} | {kib:.0f} | {ratio} | {flushes} | {syncs} | {spf} |")
PY

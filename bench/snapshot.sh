#!/usr/bin/env bash
# Issue 6's scenario: a snapshot (persistent COW, dm's format) stacked on a
# 1024-segment linear table, served by one nbdmapper process:
#
#   base   1024 linear segments, 8000 sectors each, 16384 apart, one file
#   snap   snapshot /dev/mapper/base cow.img P <chunk>
#
# fio's nbd engine writes 4k at random with fsync=1 (a FLUSH after every
# write), iodepth 1, one job, in four cases, interleaved REPS times:
#
#   base, direct         the linear table itself, region written once
#                        before measuring (reference)
#   snap, steady state   a 64 MiB region whose chunks all have exceptions
#                        already (written once before measuring): writes
#                        go in place to the COW
#   snap, first write    chunk 8 (4 KiB): every write allocates a chunk
#                        and commits an exception (sync, metadata, sync)
#   snap, first write    chunk 32 (16 KiB, dm's default): as above, plus
#                        a 12 KiB read of the origin to fill the chunk
#
#   bench/snapshot.sh [RUNTIME_S] [REPS]     defaults: 10 s, 3
#
# NBDMAPPER_BIN picks the binary (default: built from this checkout).
# Prints a markdown table (median IOPS, ratio to the reference, COW syncs
# per write from the server's flush stats when it logs them) and leaves it
# with fio's JSON and server logs in bench/results/snapshot-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-10}
reps=${2:-3}

. bench/lib.sh
bench_setup snapshot fio python3 go

segs=1024 seglen=8000 stride=16384
total=$((segs * seglen))
region=$((64 << 20))
for ((i = 0; i < segs; i++)); do
	echo "$((i * seglen)) $seglen linear $work/base.img $((i * stride))"
done >"$work/base.table"

fresh() { # fresh CHUNK: new sparse files and tables
	rm -f "$work/base.img" "$work/cow.img"
	truncate -s $((segs * stride * 512)) "$work/base.img"
	truncate -s $((total * 512 * 3 / 2)) "$work/cow.img"
	echo "0 $total snapshot /dev/mapper/base $work/cow.img P $1" >"$work/snap.table"
}

serve() { # serve ID: start the server on a fresh socket
	sock=$work/$1.sock
	"$work/nbdmapper" serve --metrics off --control off --socket "$sock" "base=$work/base.table" "snap=$work/snap.table" 2>"$out/$1.log" &
	pid=$!
	wait_socket "$sock" "$pid" "$out/$1.log"
}

run_fio() { # run_fio ID EXPORT SIZE
	fio --name=snap --ioengine=nbd "--uri=nbd+unix:///$2?socket=$sock" \
		--rw=randwrite --bs=4k --iodepth=1 --fsync=1 --size="$3" \
		--time_based --runtime="$runtime" \
		--output-format=json --output="$out/$1.json" >/dev/null
}

# name | export | chunk | size | prefill
cases=(
	"base (1024 linear segments), direct|base|8|$region|prefill"
	"snap, steady state (chunks already copied)|snap|8|$region|prefill"
	"snap, first write, chunk 8 (4 KiB)|snap|8|$((total * 512))|"
	"snap, first write, chunk 32 (16 KiB)|snap|32|$((total * 512))|"
)

: >"$out/runs"
for ((rep = 1; rep <= reps; rep++)); do
	for i in "${!cases[@]}"; do
		IFS='|' read -r name export chunk size prefill <<<"${cases[$i]}"
		id=$i-r$rep
		fresh "$chunk"
		serve "$id"
		if [ -n "$prefill" ]; then
			fio --name=prefill --ioengine=nbd "--uri=nbd+unix:///$export?socket=$sock" \
				--rw=write --bs=1m --iodepth=4 --size="$size" >/dev/null
		fi
		run_fio "$id" "$export" "$size"
		kill -INT "$pid"
		wait "$pid" || true
		cow_kib=$(du -k "$work/cow.img" | cut -f1)
		printf '%s|%s|%s\n' "$id" "$name" "$cow_kib" >>"$out/runs"
	done
done

{
	echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), kernel $(uname -r)," \
		"filesystem $(df -T "$work" | awk 'NR==2 {print $2}'), $(fio --version), ${reps} x ${runtime}s per row"
	echo
} >"$out/machine"
python3 - "$out" <<'PY' | tee "$out/table.md"
import json, statistics, sys
out = sys.argv[1]
print(open(f"{out}/machine").read(), end="")
rows = {}  # name -> [iops...], [p50 usec...], [cow KiB...]
order = []
for line in open(f"{out}/runs"):
    id_, name, cow = line.rstrip("\n").split("|")
    w = json.load(open(f"{out}/{id_}.json"))["jobs"][0]
    wr = w["write"]
    # with fsync=1 a write's cost is the write plus its flush
    lat = wr["clat_ns"]["percentile"]["50.000000"] / 1000 + w["sync"]["lat_ns"]["percentile"]["50.000000"] / 1000
    if name not in rows:
        order.append(name)
        rows[name] = [[], [], []]
    rows[name][0].append(wr["iops"])
    rows[name][1].append(lat)
    rows[name][2].append(int(cow))
print("| case | IOPS | write+flush p50 (µs) | vs base | COW allocated (KiB) |")
print("|---|---:|---:|---:|---:|")
ref = statistics.median(rows[order[0]][0])
for name in order:
    iops, lat, cow = (statistics.median(v) for v in rows[name])
    print(f"| {name} | {iops:.0f} | {lat:.0f} | {iops / ref:.3f} | {cow:.0f} |")
PY

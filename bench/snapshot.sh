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
# then the same first writes with many in flight (issue 16: exceptions
# that are ready together share one commit), each against the base table
# on the same workload, first writes over the whole 4 GiB device so that
# nearly every write is a chunk's first:
#
#   16 jobs              16 connections, iodepth 1 each, fsync=1
#   iodepth 32           one connection, 32 writes in flight, fsync=1
#   iodepth 32, no fsync the same without flushes: the base table's
#                        writes never sync, a first write's commit does
#
# Syncs per write are every backing device's syncs (the server's flush
# stats at shutdown: the commits' and the flushes') over fio's writes.
#
# Then, unless GUEST=0, bench/snapshot-guest.sh runs the 16-job and
# iodepth-32 first writes in the vmtest guest (internal/testing/vmtest/run.sh, QEMU TCG),
# on the kernel's dm-linear and dm-snapshot and on nbdmapper through
# /dev/nbd0, over the same virtio disk, for the kernel's figures.
#
#   bench/snapshot.sh [RUNTIME_S] [REPS] [GUEST_RUNTIME_S] [GUEST_REPS]   defaults: 10 s, 3, 20 s, 3
#
# HOST=0 skips the rows above and runs only the guest's.
# NBDMAPPER_BIN picks the binary (default: built from this checkout);
# BASELINE_BIN adds each first-write row run with another binary, in the
# same rounds (see run_case).
# Prints markdown tables (median IOPS, ratio to the reference of the same
# workload, syncs per write) and leaves them with fio's JSON, server logs
# and the guest's console in bench/results/snapshot-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-10}
reps=${2:-3}
guest_runtime=${3:-20}
guest_reps=${4:-3}

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

serve() { # serve ID [BINARY]: start the server on a fresh socket
	sock=$work/$1.sock
	"${2:-$work/nbdmapper}" serve --metrics off --control off --socket "$sock" "base=$work/base.table" "snap=$work/snap.table" 2>"$out/$1.log" &
	pid=$!
	wait_socket "$sock" "$pid" "$out/$1.log"
}

run_fio() { # run_fio ID EXPORT SIZE JOBS IODEPTH FSYNC
	fio --name=snap --ioengine=nbd "--uri=nbd+unix:///$2?socket=$sock" \
		--rw=randwrite --bs=4k --numjobs="$4" --iodepth="$5" --fsync="$6" --size="$3" \
		--randrepeat=0 --group_reporting --time_based --runtime="$runtime" \
		--output-format=json --output="$out/$1.json" >/dev/null
}

# name | export | chunk | size | prefill | jobs | iodepth | fsync | reference row
whole=$((total * 512))
cases=(
	"base (1024 linear segments), direct|base|8|$region|prefill|1|1|1|0"
	"snap, steady state (chunks already copied)|snap|8|$region|prefill|1|1|1|0"
	"snap, first write, chunk 8 (4 KiB)|snap|8|$whole||1|1|1|0"
	"snap, first write, chunk 32 (16 KiB)|snap|32|$whole||1|1|1|0"
	"base, 16 jobs|base|8|$whole||16|1|1|4"
	"snap, first write, chunk 8, 16 jobs|snap|8|$whole||16|1|1|4"
	"base, iodepth 32|base|8|$whole||1|32|1|6"
	"snap, first write, chunk 8, iodepth 32|snap|8|$whole||1|32|1|6"
	"base, iodepth 32, no fsync|base|8|$whole||1|32|0|8"
	"snap, first write, chunk 8, iodepth 32, no fsync|snap|8|$whole||1|32|0|8"
)

# run_case ID NAME BINARY: one case of the table below, fresh files.
run_case() {
	fresh "$chunk"
	serve "$1" "$3"
	if [ -n "$prefill" ]; then
		fio --name=prefill --ioengine=nbd "--uri=nbd+unix:///$export?socket=$sock" \
			--rw=write --bs=1m --iodepth=4 --size="$size" >/dev/null
	fi
	run_fio "$1" "$export" "$size" "$jobs" "$depth" "$fsync"
	kill -INT "$pid"
	wait "$pid" || true
	cow_kib=$(du -k "$work/cow.img" | cut -f1)
	syncs=$(grep '"flush stats"' "$out/$1.log" | tail -1 | sed -n 's/.* syncs=\([0-9]*\).*/\1/p')
	printf '%s|%s|%s|%s|%s\n' "$1" "$2" "$cow_kib" "${syncs:-0}" "${cases[$ref]%%|*}" >>"$out/runs"
}

# BASELINE_BIN=PATH runs every first-write case again, right after the
# binary under test, with that binary (an older nbdmapper): rows
# "... [baseline]", against the same base row.
if [ -n "${BASELINE_BIN:-}" ]; then
	cp "$BASELINE_BIN" "$work/baseline"
fi
: >"$out/runs"
[ "${HOST:-1}" != 0 ] || reps=0 # HOST=0: the guest rows only
for ((rep = 1; rep <= reps; rep++)); do
	for i in "${!cases[@]}"; do
		IFS='|' read -r name export chunk size prefill jobs depth fsync ref <<<"${cases[$i]}"
		run_case "$i-r$rep" "$name" "$work/nbdmapper"
		if [ -n "${BASELINE_BIN:-}" ] && [[ $name == *"first write"* ]]; then
			run_case "$i-r$rep-b" "$name [baseline]" "$work/baseline"
		fi
	done
done

{
	echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), kernel $(uname -r)," \
		"filesystem $(df -T "$work" | awk 'NR==2 {print $2}'), $(fio --version), ${reps} x ${runtime}s per row"
	echo
} >"$out/machine"
[ ! -s "$out/runs" ] || python3 - "$out" <<'PY' | tee "$out/table.md"
import json, statistics, sys
out = sys.argv[1]
print(open(f"{out}/machine").read(), end="")
rows = {}  # name -> [iops...], [p50 usec...], [cow KiB...], [syncs per write...]
order, refs = [], {}
for line in open(f"{out}/runs"):
    id_, name, cow, syncs, ref = line.rstrip("\n").split("|")
    w = json.load(open(f"{out}/{id_}.json"))["jobs"][0]
    wr = w["write"]
    # with fsync=1 a write's cost is the write plus its flush
    lat = wr["clat_ns"]["percentile"]["50.000000"] / 1000
    if "sync" in w and w["sync"]["total_ios"]:
        lat += w["sync"]["lat_ns"]["percentile"]["50.000000"] / 1000
    if name not in rows:
        order.append(name)
        refs[name] = ref
        rows[name] = [[], [], [], []]
    rows[name][0].append(wr["iops"])
    rows[name][1].append(lat)
    rows[name][2].append(int(cow))
    rows[name][3].append(int(syncs) / max(wr["total_ios"], 1))
print("| case | IOPS | write+flush p50 (µs) | vs base | syncs per write | COW allocated (KiB) |")
print("|---|---:|---:|---:|---:|---:|")
for name in order:
    iops, lat, cow, spw = (statistics.median(v) for v in rows[name])
    ref = statistics.median(rows[refs[name]][0])
    print(f"| {name} | {iops:.0f} | {lat:.0f} | {iops / ref:.3f} | {spw:.3f} | {cow:.0f} |")
PY

if [ "${GUEST:-1}" != 0 ]; then
	set +e
	internal/testing/vmtest/run.sh -o "$out/vm" -d 2048 -t 3600 bench/snapshot-guest.sh "$guest_runtime" "$guest_reps" >"$out/guest.log"
	rc=$?
	set -e
	rm -f "$out/vm/disk.img"
	if [ "$rc" != 0 ]; then
		tail -30 "$out/guest.log" >&2
		echo "bench/snapshot.sh: guest run failed ($rc)" >&2
		exit 1
	fi
	{
		echo
		echo "guest: kernel $(sed -n 's/^VMTEST-BOOTED //p' "$out/guest.log" | tr -d '\r'), QEMU TCG 2 vCPUs, 2 GiB raw disk on virtio-blk cache=writeback, ${guest_reps} x ${guest_runtime}s per row, medians"
		echo
		echo "| case | IOPS | IOPS per round | vs base (same device kind) | disk flushes per write |"
		echo "|---|---:|---|---:|---:|"
		guest_rounds SNAPBENCH <"$out/guest.log" | awk '
			{ c = $1; name[n++] = c; m[c] = $2; w[c] = $3; fl[c] = $4; all[c] = $5 }
			END {
				for (i = 0; i < n; i++) {
					c = name[i]; b = c
					sub(/snap/, "base", b); sub(/-first/, "", b)
					mb = (b in m) ? m[b] : 0
					r = all[c]; gsub(/,/, ", ", r)
					printf "| %s | %d | %s | %.3f | %.2f |\n", c, m[c], r, (mb > 0 ? m[c] / mb : 0), (w[c] > 0 ? fl[c] / w[c] : 0)
				}
			}'
	} | tee -a "$out/table.md"
fi

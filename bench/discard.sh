#!/usr/bin/env bash
# The seed scenario of issue 4: a whole-device discard through a table whose
# 1024 segments alternate between two files (segment i on file i%2, like a
# btrfs DUP profile). Issued range by range in arrival order, it reaches the
# files as 1024 small discards that ping-pong between them; sorted, merged
# and batched per file, it can be one call per file.
#
# Workloads, each in one run against three servers:
#   fio rw=trim bs=1M   the whole device, one segment per TRIM, iodepth 32
#   fio rw=trim bs=64k  the whole device in 16384 small TRIMs, iodepth 32
#   one TRIM            the whole device in a single request (like blkdiscard)
# Servers:
#   baseline            --discard-baseline: every mapped range at once, in order
#   per request         sort and merge within each request only
#   window 1ms          trims arriving within 1 ms of a batch's first are batched
#   group commit        the default: trims arriving while others are issued
#                       are batched
#
# Calls reaching the files come from the server's "discard stats" log line
# and are cross-checked against fallocate(2) calls counted by strace when
# strace is installed (STRACE=0 turns that off: tracing slows each call, so
# time is best measured without it). Before each run the files are fully allocated again
# (fallocate), so every discard really frees blocks.
#
#   [STRACE=0] [DELAY=1ms] bench/discard.sh [IODEPTH [REPS]]     defaults: 32, 3
#
# DELAY=D puts each file behind an nbdkit (file plugin, delay filter) whose
# trims take D, on a unix socket, and the table's lines name those exports:
# a device whose discards are slow, as an SSD's are, instead of ext4's
# cheap hole punching. The calls to files are then NBD TRIMs to nbdkit.
#
# Each case runs REPS times, interleaved; the table shows medians.
# Prints a markdown table and leaves it with fio's JSON and the server logs
# in bench/results/discard-*/. Needs 1 GiB of free space.
set -euo pipefail
cd "$(dirname "$0")/.."
iodepth=${1:-32}
reps=${2:-3}

. bench/lib.sh
bench_setup discard fio python3 go fallocate
nbdsh=$(command -v nbdsh) || { echo "bench/discard.sh: nbdsh missing (libnbd-bin)" >&2; exit 1; }
strace=
[ "${STRACE:-1}" != 0 ] && strace=$(command -v strace || true)

segs=1024 seglen=2048 # sectors: 1 MiB segments, a 1 GiB device
a=$work/a.img
b=$work/b.img
size=$((segs * seglen * 512))
devs=("$a" "$b")
if [ -n "${DELAY:-}" ]; then
	command -v nbdkit >/dev/null || { echo "bench/discard.sh: DELAY needs nbdkit" >&2; exit 1; }
	devs=("nbd+unix:///?socket=$work/a.sock" "nbd+unix:///?socket=$work/b.sock")
fi
for ((i = 0; i < segs; i++)); do
	echo "$((i * seglen)) $seglen linear ${devs[i % 2]} $((i / 2 * seglen))"
done >"$work/interleaved.table"

# slow_files: with DELAY, serves a.img and b.img through nbdkit with trims
# taking DELAY, on a.sock and b.sock; sets slow_pids.
slow_pids=()
slow_files() {
	local f
	slow_pids=()
	[ -n "${DELAY:-}" ] || return 0
	for f in a b; do
		rm -f "$work/$f.sock"
		nbdkit --foreground --unix "$work/$f.sock" --filter=delay file "$work/$f.img" "delay-trim=$DELAY" 2>>"$out/nbdkit.log" &
		slow_pids+=($!)
		wait_socket "$work/$f.sock" "$!" "$out/nbdkit.log"
	done
}

# name | client command (SOCK and OUT are replaced)
workloads=(
	"fio rw=trim bs=1M|fio --name=trim --ioengine=nbd --uri=nbd+unix:///bench?socket=SOCK --rw=trim --bs=1M --iodepth=$iodepth --size=$size --output-format=json --output=OUT"
	"fio rw=trim bs=64k|fio --name=trim --ioengine=nbd --uri=nbd+unix:///bench?socket=SOCK --rw=trim --bs=64k --iodepth=$iodepth --size=$size --output-format=json --output=OUT"
	"one TRIM of the device|$nbdsh -u nbd+unix:///bench?socket=SOCK -c h.trim(h.get_size(),0)"
)
# name | serve flags
servers=(
	"baseline (each range at once)|--discard-baseline"
	"per request|--discard-per-request"
	"window 1ms|--discard-window=1ms"
	"group commit (default)|"
)

: >"$out/runs"
for ((r = 0; r < reps; r++)); do
	for w in "${!workloads[@]}"; do
		IFS='|' read -r wname wcmd <<<"${workloads[$w]}"
		for s in "${!servers[@]}"; do
			IFS='|' read -r sname sflags <<<"${servers[$s]}"
			id=w$w-s$s-r$r
			sock=$work/$id.sock
			rm -f "$a" "$b"
			fallocate -l $((size / 2)) "$a"
			fallocate -l $((size / 2)) "$b"
			sync
			slow_files
			trace=()
			[ -n "$strace" ] && trace=("$strace" -f -qq --seccomp-bpf -c -e trace=fallocate -o "$out/$id.strace")
			"${trace[@]}" "$work/nbdmapper" serve --metrics off --control off --socket "$sock" $sflags "bench=$work/interleaved.table" 2>"$out/$id.log" &
			pid=$!
			wait_socket "$sock" "$pid" "$out/$id.log"
			start=$(date +%s.%N)
			# shellcheck disable=SC2086
			PATH=$(dirname "$nbdsh"):$PATH $(echo "$wcmd" | sed "s|SOCK|$sock|; s|OUT|$out/$id.json|") >"$out/$id.client" 2>"$out/$id.err" ||
				{ echo "client failed: $wname / $sname" >&2; cat "$out/$id.err" >&2; exit 1; }
			end=$(date +%s.%N)
			# Under strace, $pid is strace: interrupt the server itself.
			srv=$pid
			[ -n "$strace" ] && srv=$(pgrep -P "$pid" -x nbdmapper || echo "$pid")
			kill -INT "$srv"
			wait "$pid" || true
			if ((${#slow_pids[@]})); then
				kill "${slow_pids[@]}"
				wait "${slow_pids[@]}" || true
			fi
			allocated=$(( $(stat -c %b "$a") + $(stat -c %b "$b") ))
			printf '%s|%s|%s|%s|%s\n' "$id" "$wname" "$sname" "$(awk "BEGIN {print $end - $start}")" "$allocated" >>"$out/runs"
		done
	done
done

{
	echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), kernel $(uname -r)," \
		"filesystem $(df -T "$work" | awk 'NR==2 {print $2}'), $(fio --version), iodepth $iodepth, medians of $reps runs;" \
		"1024 x 1 MiB segments alternating over two 512 MiB files, fully allocated before each run${DELAY:+, each behind nbdkit with trims taking $DELAY}"
	echo
} >"$out/machine"
python3 - "$out" <<'PY' | tee "$out/table.md"
import json, re, statistics, sys
out = sys.argv[1]
print(open(f"{out}/machine").read(), end="")
rows = {}  # (workload, server) -> list of (requests, ranges in, calls, fallocates, seconds, blocks left)
for line in open(f"{out}/runs"):
    id_, wname, sname, secs, left = line.rstrip("\n").split("|")
    secs = float(secs)
    log = open(f"{out}/{id_}.log").read()
    m = re.search(r'msg="discard stats" ranges_in=(\d+) calls=(\d+)', log)
    rin, calls = (int(m[1]), int(m[2])) if m else (0, 0)
    fa = None
    try:
        m = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?fallocate", open(f"{out}/{id_}.strace").read(), re.M)
        fa = int(m[1]) if m else 0
    except FileNotFoundError:
        pass
    reqs = 1
    if wname.startswith("fio"):
        j = json.load(open(f"{out}/{id_}.json"))["jobs"][0]["trim"]
        reqs = j["total_ios"]
        secs = j["runtime"] / 1000 or secs
    rows.setdefault((wname, sname), []).append((reqs, rin, calls, fa, secs, int(left)))

def med(xs):
    return statistics.median(xs)

print("| workload | server | requests | ranges in | calls to files | fallocate (strace) | fewer calls than baseline | time s | faster than baseline | blocks left |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
base = {}
for (wname, sname), rs in rows.items():
    reqs, rin, calls = med([r[0] for r in rs]), med([r[1] for r in rs]), med([r[2] for r in rs])
    fas = [r[3] for r in rs if r[3] is not None]
    fa = f"{med(fas):.0f}" if fas else "-"
    secs, left = med([r[4] for r in rs]), max(r[5] for r in rs)
    if sname.startswith("baseline"):
        base[wname] = (calls, secs)
    bc, bs = base.get(wname, (0, 0))
    fewer = f"{bc / calls:.0f}x" if calls and bc else "-"
    faster = f"{bs / secs:.2f}x" if secs and bs else "-"
    print(f"| {wname} | {sname} | {reqs:.0f} | {rin:.0f} | {calls:.0f} | {fa} | {fewer} | {secs:.3f} | {faster} | {left} |")
PY

#!/usr/bin/env bash
# Remote segments over a network of the script's own (issue 15): four
# "hosts", each a network namespace joined to a client namespace by a veth
# pair (10.99.H.1 <-> 10.99.H.2), each serving a file with nbdkit on
# 10.99.H.2:10809. The kernel here has no netem, so each host is made
# LAN-like with nbdkit filters: `delay` adds DELAY (1 ms) to every read,
# write, zero and trim; `rate` caps the host at RATE (1 Gbit/s, a 1 GbE
# link); --threads THREADS (2) per connection bounds what it does at once.
# nbdmapper serve runs in the client namespace (--remote-connections 4
# each) and fio's nbd engine drives it through a unix socket from outside.
#
#   bench/remote.sh [RUNTIME_S] [REPS]        defaults: 5 s, 3
#   env: DELAY=1ms RATE=1G THREADS=2 SIZE_MIB=512 (per host) CHUNK_KIB=1024
#
# Throughput: tables striped over 1, 2 and 4 hosts (chunk CHUNK_KIB), each
# host's file whole; workloads 1M sequential read and write at queue depth
# 16, 4k random read and write at queue depth 64. fdatasync: 4k random
# writes with --fsync=1 (a FLUSH after each write) at queue depth 1, over
# one segment vs 1024 segments of one host, over four segments (one per
# host) vs 1024 segments spread over the four, and over the 1024 with
# --flush-baseline=per-segment (one NBD flush per table line, as dm before
# Linux 6.11 would send). Cases take turns within each repetition; the
# tables show medians. Needs root (namespaces). Leaves fio's JSON, the
# server logs and table.md in bench/results/remote-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-5}
reps=${2:-3}
delay=${DELAY:-1ms}
rate=${RATE:-1G}
threads=${THREADS:-2}
size_mib=${SIZE_MIB:-512}
chunk_kib=${CHUNK_KIB:-1024}
[ "$(id -u)" = 0 ] || { echo "bench/remote.sh: needs root (network namespaces)" >&2; exit 1; }

. bench/lib.sh
bench_setup remote fio nbdkit ip python3 go
ns=nbdmb$$
cleanup() {
	kill $(jobs -p) 2>/dev/null || true
	wait 2>/dev/null || true
	for n in c h1 h2 h3 h4; do ip netns del "$ns$n" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT

# The network: nothing of it exists outside the five namespaces.
ip netns add "${ns}c"
ip -n "${ns}c" link set lo up
for h in 1 2 3 4; do
	ip netns add "${ns}h$h"
	ip link add "vc$h" netns "${ns}c" type veth peer name "vh$h" netns "${ns}h$h"
	ip -n "${ns}c" addr add "10.99.$h.1/24" dev "vc$h"
	ip -n "${ns}h$h" addr add "10.99.$h.2/24" dev "vh$h"
	ip -n "${ns}c" link set "vc$h" up
	ip -n "${ns}h$h" link set "vh$h" up
	ip -n "${ns}h$h" link set lo up
	# Fully allocated, so no case pays for allocating holes.
	fallocate -l "${size_mib}M" "$work/h$h.img"
	dd if=/dev/zero of="$work/h$h.img" bs=4M count=$((size_mib / 4)) conv=notrunc,fsync status=none
	ip netns exec "${ns}h$h" nbdkit -f -i "10.99.$h.2" -p 10809 --threads "$threads" \
		--filter=rate --filter=delay file "$work/h$h.img" rate="$rate" \
		delay-read="$delay" delay-write="$delay" 2>"$out/h$h.log" &
done
for h in 1 2 3 4; do
	for ((i = 0; i < 100; i++)); do
		ip netns exec "${ns}c" bash -c "exec 3<>/dev/tcp/10.99.$h.2/10809" 2>/dev/null && break
		sleep 0.1
	done
done

sectors=$((size_mib * 2048))
chunk=$((chunk_kib * 2))
uri() { echo "nbd://10.99.$1.2:10809/"; }
echo "0 $sectors linear $(uri 1) 0" >"$work/s1.table"
echo "0 $((2 * sectors)) striped 2 $chunk $(uri 1) 0 $(uri 2) 0" >"$work/s2.table"
echo "0 $((4 * sectors)) striped 4 $chunk $(uri 1) 0 $(uri 2) 0 $(uri 3) 0 $(uri 4) 0" >"$work/s4.table"
seg=$((sectors / 1024))
for ((i = 0; i < 1024; i++)); do
	echo "$((i * seg)) $seg linear $(uri 1) $(((i * 389 % 1024) * seg))"
done >"$work/f1x1024.table"
for h in 1 2 3 4; do
	echo "$(((h - 1) * sectors)) $sectors linear $(uri "$h") 0"
done >"$work/f4.table"
seg4=$((4 * sectors / 1024))
for ((i = 0; i < 1024; i++)); do
	echo "$((i * seg4)) $seg4 linear $(uri $((i % 4 + 1))) $(((i / 4 * 389 % 256) * seg4))"
done >"$work/f4x1024.table"

exports=(s1 s2 s4 f1x1024 f4 f4x1024)
args=()
for x in "${exports[@]}"; do args+=("$x=$work/$x.table"); done
args+=("f1=$work/s1.table")
serve() { # SOCK LOG [flags]
	local sock=$1 log=$2
	shift 2
	ip netns exec "${ns}c" "$work/nbdmapper" serve --socket "$sock" --metrics off --control off "$@" "${args[@]}" 2>"$log" &
	wait_socket "$sock" $! "$log"
}
serve "$work/nbd.sock" "$out/serve.log"
serve "$work/base.sock" "$out/serve-baseline.log" --flush-baseline=per-segment

# name | export | socket | fio arguments
cases=(
	"1M read qd16|s|nbd|--rw=read --bs=1M --iodepth=16"
	"1M write qd16|s|nbd|--rw=write --bs=1M --iodepth=16"
	"4k randread qd64|s|nbd|--rw=randread --bs=4k --iodepth=64"
	"4k randwrite qd64|s|nbd|--rw=randwrite --bs=4k --iodepth=64"
)
fsync_cases=(
	"1 host, 1 segment|f1|nbd"
	"1 host, 1024 segments|f1x1024|nbd"
	"4 hosts, 4 segments|f4|nbd"
	"4 hosts, 1024 segments|f4x1024|nbd"
	"4 hosts, 1024 segments, per-segment flush (dm < 6.11)|f4x1024|base"
)
: >"$out/runs"
for ((rep = 1; rep <= reps; rep++)); do
	for c in "${cases[@]}"; do
		IFS='|' read -r name x sock fargs <<<"$c"
		for n in 1 2 4; do
			id=$(echo "$name" | tr -c 'a-z0-9\n' '_')-$n-r$rep
			# shellcheck disable=SC2086
			fio --name=t --ioengine=nbd "--uri=nbd+unix:///$x$n?socket=$work/$sock.sock" $fargs \
				--time_based --runtime="$runtime" --ramp_time=2 --randrepeat=0 \
				--output-format=json --output="$out/$id.json" >/dev/null
			printf 'tput|%s|%s|%s\n' "$id" "$n" "$name" >>"$out/runs"
		done
	done
	for c in "${fsync_cases[@]}"; do
		IFS='|' read -r name x sock <<<"$c"
		id=fsync-$x-$sock-r$rep
		fio --name=t --ioengine=nbd "--uri=nbd+unix:///$x?socket=$work/$sock.sock" \
			--rw=randwrite --bs=4k --iodepth=1 --fsync=1 --time_based --runtime="$runtime" --ramp_time=1 \
			--randrepeat=0 --output-format=json --output="$out/$id.json" >/dev/null
		printf 'fsync|%s|1|%s\n' "$id" "$name" >>"$out/runs"
	done
done
for pid in $(jobs -p); do kill -INT "$pid" 2>/dev/null || true; done
wait 2>/dev/null || true

{
	echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), kernel $(uname -r)," \
		"$(fio --version), $(nbdkit --version | head -1); load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
	echo "hosts: nbdkit file, delay $delay per read and write, rate $rate, $threads threads per connection," \
		"${size_mib} MiB each; stripe chunk ${chunk_kib} KiB; ${reps} x ${runtime}s per row (after a 2 s ramp)"
	echo
} >"$out/machine"
python3 - "$out" <<'PY' | tee "$out/table.md"
import json, statistics, sys
out = sys.argv[1]
print(open(f"{out}/machine").read(), end="")
tput, fsync = {}, {}
for line in open(f"{out}/runs"):
    kind, id_, n, name = line.rstrip("\n").split("|", 3)
    j = json.load(open(f"{out}/{id_}.json"))["jobs"][0]
    d = j["read"] if j["read"]["io_bytes"] else j["write"]
    if kind == "tput":
        v = d["bw_bytes"] / 2**20 if name.startswith("1M") else d["iops"]
        tput.setdefault(name, {}).setdefault(int(n), []).append(v)
    else:
        fsync.setdefault(name, []).append(j["write"]["iops"])
print("| workload | unit | 1 host | 2 hosts | 4 hosts | 4 / 1 |")
print("|---|---|---:|---:|---:|---:|")
for name, by in tput.items():
    m = {n: statistics.median(v) for n, v in by.items()}
    unit = "MiB/s" if name.startswith("1M") else "IOPS"
    print(f"| {name} | {unit} | {m[1]:.0f} | {m[2]:.0f} | {m[4]:.0f} | {m[4] / m[1]:.2f} |")
print()
print("| fdatasync (4k randwrite, fsync=1, qd1) | IOPS | vs its reference |")
print("|---|---:|---:|")
ref = None
for name, v in fsync.items():
    m = statistics.median(v)
    if "1024" not in name:
        ref = m
    print(f"| {name} | {m:.0f} | {m / ref:.3f} |")
PY

#!/usr/bin/env bash
# RBD images behind nbdmapper's native rbd: device against `qemu-nbd rbd:`
# (issue 50), on a throwaway single-node cluster (scripts/ceph-cluster.sh:
# 1 mon, 1 mgr, 1 BlueStore OSD on a sparse file in a temporary folder, all
# on 127.0.0.1). fio's nbd engine drives each server through a unix socket.
#
#   bench/ceph.sh [RUNTIME_S] [REPS]        defaults: 10 s, 3
#   env: SIZE_MIB=256 (per image)
#
# One image, nbdmapper (`0 N linear rbd:rbd/img:conf=...`) vs qemu-nbd
# (`qemu-nbd -f raw rbd:rbd/img:conf=...`, its default writeback cache, as
# nbdmapper leaves librbd's `rbd cache` at its default): 4k random writes at
# queue depth 16, the same with --fsync=1 (a FLUSH after each write), and
# 4k random reads at queue depth 16. Then reads through nbdmapper over one
# image vs a table striped (1 MiB chunks) over four: 1M sequential and 4k
# random at queue depth 16. All on the one OSD here, so the striped rows
# show the client's parallelism, not the cluster's. Cases take turns within
# each repetition; the table shows medians and each repetition's ratio,
# the rbd_flush calls per client flush and, for a whole-device trim of the
# 1024-line table, the rbd_discard calls. Leaves fio's JSON, the server
# logs and table.md in bench/results/ceph-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-10}
reps=${2:-3}
size_mib=${SIZE_MIB:-256}

. bench/lib.sh
bench_setup ceph fio qemu-nbd python3 go ceph-mon ceph-osd ceph-mgr rbd
if [ -z "${NBDMAPPER_BIN:-}" ]; then
	go build -tags ceph,pacific -o "$work/nbdmapper" ./cmd/nbdmapper
fi
cluster=$work/cluster
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; scripts/ceph-cluster.sh stop "$cluster"; rm -rf "$work"; restore_reporting' EXIT
conf=$(scripts/ceph-cluster.sh start "$cluster" $((30000 + $$ % 20000)))
rbd() { command rbd -c "$conf" "$@"; }

# Images filled with data, so that reads read objects, not holes.
for img in one s0 s1 s2 s3; do
	rbd create --size "${size_mib}M" "rbd/$img"
	rbd bench --io-type write --io-size 4M --io-pattern seq --io-total "${size_mib}M" "rbd/$img" >/dev/null
done
sectors=$((size_mib * 2048))
dev() { echo "rbd:rbd/$1:conf=$conf"; }
echo "0 $sectors linear $(dev one) 0" >"$work/one.table"
echo "0 $((sectors * 4)) striped 4 2048 $(dev s0) 0 $(dev s1) 0 $(dev s2) 0 $(dev s3) 0" >"$work/str.table"
# 1024 lines over the one image, for the trim row.
seg=$((sectors / 1024))
for i in $(seq 0 1023); do echo "$((i * seg)) $seg linear $(dev one) $((i * seg))"; done >"$work/lines.table"

# serve KIND TABLE: starts a server on $sock, its pid in $pid.
serve() {
	sock=$work/$id.sock
	if [ "$1" = qemu-nbd ]; then
		qemu-nbd -f raw --persistent -k "$sock" -x bench "$(dev one)" 2>"$out/$id.log" &
	else
		"$work/nbdmapper" serve --metrics off --control off --socket "$sock" "bench=$work/$2.table" 2>"$out/$id.log" &
	fi
	pid=$!
	wait_socket "$sock" "$pid" "$out/$id.log"
}

# run ID SERVER TABLE FIO-ARGS...
run() {
	id=$1 server=$2 tab=$3
	shift 3
	serve "$server" "$tab"
	fio --name=ceph --ioengine=nbd "--uri=nbd+unix:///bench?socket=$sock" --bs=4k --iodepth=16 \
		--size="$((size_mib))M" --time_based --runtime="$runtime" --randrepeat=0 \
		--output-format=json --output="$out/$id.json" "$@" >/dev/null
	kill -INT "$pid"
	wait "$pid" || true
}

keep_free_memory
for rep in $(seq "$reps"); do
	for server in nbdmapper qemu-nbd; do
		run "w16-$server-$rep" "$server" one --rw=randwrite
		run "f16-$server-$rep" "$server" one --rw=randwrite --fsync=1
		run "r16-$server-$rep" "$server" one --rw=randread
	done
	for tab in one str; do
		run "seq-$tab-$rep" nbdmapper "$tab" --rw=read --bs=1M
		run "rnd-$tab-$rep" nbdmapper "$tab" --rw=randread
	done
done
# One whole-device trim over 1024 lines of one image (nbdsh with the system
# python3, which has the nbd module).
id=trim
serve nbdmapper lines
PATH=/usr/bin:$PATH nbdsh -u "nbd+unix:///bench?socket=$sock" -c 'h.trim(h.get_size(), 0)' -c 'h.flush()'
kill -INT "$pid"
wait "$pid" || true
used=$(rbd du --format json rbd/one | python3 -c 'import json, sys; print(json.load(sys.stdin)["images"][0]["used_size"])')

{
	bench_machine
	echo "ceph: $(ceph --version | cut -d' ' -f3), 1 mon, 1 mgr, 1 BlueStore OSD on a sparse file (osd memory target 896 MiB); images of ${size_mib} MiB written in full first"
	echo "${reps} x ${runtime}s per row, 4k blocks unless said, queue depth 16; commit $(git rev-parse --short HEAD)"
	echo
} >"$out/machine"
python3 - "$out" "$reps" "$used" <<'PY' | tee "$out/table.md"
import json, re, statistics, sys
out, reps, used = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(open(f"{out}/machine").read(), end="")

def job(id_):
    return json.load(open(f"{out}/{id_}.json"))["jobs"][0]

def med(prefix, kind, key):
    return statistics.median(job(f"{prefix}-{r}")[kind][key] for r in range(1, reps + 1))

def stats(prefix):
    flushes = syncs = 0
    for r in range(1, reps + 1):
        m = re.search(r'msg="flush stats" flushes=(\d+) syncs=(\d+)', open(f"{out}/{prefix}-{r}.log").read())
        if m:
            flushes += int(m[1]); syncs += int(m[2])
    return f"{syncs / flushes:.2f}" if flushes else "-"

# The ratio within each repetition, where the two cases ran back to back:
# the cluster's speed drifts through a run, so it is the figure to read.
def ratios(a, b, kind, key):
    return ", ".join(f"{job(f'{a}-{r}')[kind][key] / job(f'{b}-{r}')[kind][key]:.2f}" for r in range(1, reps + 1))

print("| workload | nbdmapper IOPS | qemu-nbd IOPS | median ratio | ratio per repetition | rbd_flush per client flush |")
print("|---|---:|---:|---:|---|---:|")
for w, name, kind in [("w16", "4k random write", "write"), ("f16", "4k random write, fsync=1", "write"), ("r16", "4k random read", "read")]:
    a, b = med(f"{w}-nbdmapper", kind, "iops"), med(f"{w}-qemu-nbd", kind, "iops")
    print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f} | {ratios(f'{w}-nbdmapper', f'{w}-qemu-nbd', kind, 'iops')} | {stats(f'{w}-nbdmapper') if w == 'f16' else '-'} |")
print()
print("| reads through nbdmapper | one image | striped over 4 | median ratio | ratio per repetition |")
print("|---|---:|---:|---:|---|")
a, b = med("seq-one", "read", "bw_bytes") / 2**20, med("seq-str", "read", "bw_bytes") / 2**20
print(f"| 1M sequential, MiB/s | {a:.0f} | {b:.0f} | {b / a:.2f} | {ratios('seq-str', 'seq-one', 'read', 'bw_bytes')} |")
a, b = med("rnd-one", "read", "iops"), med("rnd-str", "read", "iops")
print(f"| 4k random, IOPS | {a:.0f} | {b:.0f} | {b / a:.2f} | {ratios('rnd-str', 'rnd-one', 'read', 'iops')} |")
print()
m = re.search(r'msg="discard stats" ranges_in=(\d+) calls=(\d+)', open(f"{out}/trim.log").read())
print(f"One trim of the whole 1024-line table: {m[1]} ranges in, {m[2]} rbd_discard calls; rbd du afterwards: {used} bytes used.")
PY

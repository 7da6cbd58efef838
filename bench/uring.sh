#!/usr/bin/env bash
# What io_uring would save nbdmapper on its backing I/O (issue 13's
# evaluation), measured with fio alone on this machine's kernel and file
# system: 4k random reads and writes of a cached 1 GiB file, each way a
# server could issue them:
#
#   psync, 1 job         pread/pwrite, one request at a time
#   io_uring, iodepth 1  the same through the ring: one submission and one
#                        completion per request (the cost of a call each way)
#   psync, 32 jobs       pread/pwrite from 32 threads, one request each:
#                        what nbdmapper does (a goroutine per request in
#                        flight, each blocking in its own system call)
#   io_uring, iodepth 32 one thread, 32 requests in the ring; and with
#                        submissions in batches of 8
#
# Reports IOPS and CPU µs per request (the user + system time of fio and
# its job processes over the requests, so setup is included), medians of ROUNDS interleaved runs. The CPU per request is
# what to set beside nbdmapper's own (bench/peers.sh's CPU column): the
# difference between the two engines is the most io_uring could take off
# it for the disk side.
#
#   bench/uring.sh [RUNTIME_S] [ROUNDS]   defaults: 5 s, 3
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-5}
rounds=${2:-3}

. bench/lib.sh
bench_setup uring fio python3 go
bench_machine | tee "$out/machine.md"
disk=$work/disk.img
dd if=/dev/urandom of="$disk" bs=1M count=1024 status=none
cat "$disk" >/dev/null # in the page cache, as a served file's hot set is
# (and fio is told not to drop it: --invalidate=0)

# cpu_of CMD...: runs CMD, then prints the user + system seconds it and
# every process it started used (getrusage of the children) to stderr.
cpu_of() {
	python3 -c 'import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(r.ru_utime + r.ru_stime, file=sys.stderr)' "$@"
}

cases=(
	"psync-1job|--ioengine=psync --numjobs=1"
	"io_uring-qd1|--ioengine=io_uring --iodepth=1"
	"psync-32jobs|--ioengine=psync --numjobs=32"
	"io_uring-qd32|--ioengine=io_uring --iodepth=32"
	"io_uring-qd32-batch8|--ioengine=io_uring --iodepth=32 --iodepth_batch_submit=8 --iodepth_batch_complete_min=1"
)
for round in $(seq "$rounds"); do
	for rw in randread randwrite; do
		for c in "${cases[@]}"; do
			base=$out/${c%%|*}-$rw-$round
			# shellcheck disable=SC2086
			cpu_of fio --name=u --filename="$disk" --rw=$rw --bs=4k --size=1G --invalidate=0 ${c#*|} \
				--time_based --runtime="$runtime" --group_reporting --output-format=json \
				>"$base.json" 2>"$base.cpu"
		done
	done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.md"

python3 - "$out" "$rounds" "${cases[@]%%|*}" <<'PY' | tee "$out/table.md"
import json, statistics, sys
out, rounds, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| workload | engine | IOPS | CPU µs per request |")
print("|---|---|---:|---:|")
for rw in ("randread", "randwrite"):
    for c in cases:
        iops, cpu = [], []
        for r in range(1, rounds + 1):
            base = f"{out}/{c}-{rw}-{r}"
            side = json.load(open(f"{base}.json"))["jobs"][0]["read" if rw == "randread" else "write"]
            iops.append(side["iops"])
            cpu.append(float(open(f"{base}.cpu").read().split()[-1]) / side["total_ios"] * 1e6)
        print(f"| 4k {rw} | {c} | {statistics.median(iops):.0f} | {statistics.median(cpu):.2f} |")
PY

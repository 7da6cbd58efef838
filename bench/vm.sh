#!/usr/bin/env bash
# Kernel-level flush benchmark in a guest VM (internal/testing/vmtest/run.sh): fio 4k random
# writes with fdatasync=1 (ioengine sync, 2 jobs) on /dev/nbd0 served by
# nbdmapper over 1 and 1024 linear segments, and on the guest kernel's own
# dm-linear over the same 1 and 1024 segments of the same virtio disk
# (Debian's 6.1 kernel predates "dm: optimize flushes", so its dm sends one
# flush per target). Also nbdmapper with --flush-baseline per-segment, the
# same behaviour inside nbdmapper.
#
#   bench/vm.sh [RUNTIME_S] [REPS] [CASE...]
#
# Cases: nbdmapper-1 nbdmapper-1024 dm-1 dm-1024 nbdmapper-1024-per-segment
# (default: all). REPS interleaved rounds (default 1); IOPS and KiB/s are
# medians over the rounds, fdatasyncs and disk flushes sums.
# Prints a markdown table; the guest's console and results land in
# bench/results/vm-<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
runtime=${1:-20}
reps=${2:-1}
shift 2 || shift $#
out=bench/results/vm-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
set +e
internal/testing/vmtest/run.sh -o "$out" -d 1024 -t 3600 bench/vm-guest.sh "$runtime" "$reps" "$@" >"$out/guest.log"
rc=$?
set -e
if [ "$rc" != 0 ]; then
	tail -30 "$out/guest.log" >&2
	echo "bench/vm.sh: guest run failed ($rc)" >&2
	exit 1
fi
rm -f "$out/disk.img"

cpu=$(awk -F': ' '/model name/{print $2; exit}' /proc/cpuinfo)
kernel=$(sed -n 's/^VMTEST-BOOTED //p' "$out/guest.log" | tr -d '\r')
echo "host: $(nproc) CPUs, $cpu, kernel $(uname -r), $(qemu-system-x86_64 --version | head -1)"
echo "guest: kernel $kernel, TCG 2 vCPUs, 1 GiB raw disk on virtio-blk cache=writeback, $(fio --version)"
echo "fio: 4k randwrite, ioengine=sync, fdatasync=1, numjobs=2, runtime ${runtime}s, $reps interleaved round(s), medians"
echo
echo "| case | IOPS | KiB/s | IOPS per round | fdatasyncs | disk flushes | disk flushes per fdatasync | vs nbdmapper 1 segment |"
echo "|---|---:|---:|---|---:|---:|---:|---:|"
guest_rounds VMBENCH <"$out/guest.log" | awk '
	{ c = $1; name[n++] = c; m[c] = $2; fl[c] = $3; dfl[c] = $4; all[c] = $5 }
	END {
		base = ("nbdmapper-1" in m) ? m["nbdmapper-1"] : 0
		for (i = 0; i < n; i++) {
			c = name[i]
			r = fl[c] > 0 ? sprintf("%.2f", dfl[c] / fl[c]) : "-"
			v = base > 0 ? sprintf("%.3f", m[c] / base) : "-"
			a = all[c]; gsub(/,/, ", ", a)
			printf "| %s | %d | %d | %s | %d | %d | %s | %s |\n", c, m[c], m[c] * 4, a, fl[c], dfl[c], r, v
		}
	}'

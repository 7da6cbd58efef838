#!/usr/bin/env bash
# Kernel-level flush benchmark in a guest VM (vmtest/run.sh): fio 4k random
# writes with fdatasync=1 (ioengine sync, 2 jobs) on /dev/nbd0 served by
# nbdmapper over 1 and 1024 linear segments, and on the guest kernel's own
# dm-linear over the same 1 and 1024 segments of the same virtio disk
# (Debian's 6.1 kernel predates "dm: optimize flushes", so its dm sends one
# flush per target). Also nbdmapper with --flush-baseline per-segment, the
# same behaviour inside nbdmapper.
#
#   bench/vm.sh [RUNTIME_S] [CASE...]
#
# Prints a markdown table; the guest's console and results land in
# bench/results/vm-<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-20}
shift || true
out=bench/results/vm-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
set +e
vmtest/run.sh -o "$out" -d 1024 -t 3600 bench/vm-guest.sh "$runtime" "$@" >"$out/guest.log"
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
echo "fio: 4k randwrite, ioengine=sync, fdatasync=1, numjobs=2, runtime ${runtime}s"
echo
echo "| case | IOPS | KiB/s | fdatasyncs | disk flushes | disk flushes per fdatasync | vs nbdmapper 1 segment |"
echo "|---|---:|---:|---:|---:|---:|---:|"
tr -d '\r' <"$out/guest.log" | awk '
	$1 == "VMBENCH" { name[n++] = $2; iops[$2] = $3; bw[$2] = $4; fl[$2] = $5; dfl[$2] = $6 }
	END {
		base = iops["nbdmapper-1"]
		for (i = 0; i < n; i++) {
			c = name[i]
			r = fl[c] > 0 ? sprintf("%.2f", dfl[c] / fl[c]) : "-"
			v = base > 0 ? sprintf("%.3f", iops[c] / base) : "-"
			printf "| %s | %d | %d | %d | %d | %s | %s |\n", c, iops[c], bw[c], fl[c], dfl[c], r, v
		}
	}'

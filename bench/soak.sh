#!/usr/bin/env bash
# The chaos soak of issue 10 at length (package soak; `go test ./soak` runs
# a short one): pipelined clients on both exports of a linear + striped +
# snapshot table and its snapshot-origin, random client aborts, disks that
# fail (EIO, ENOSPC, lossy failed syncs, delays, panics) and lose power with
# requests in flight, the server rebuilt on the same files after every power
# cut, and every read, block status and post-cut sector checked against a
# model. Prints the figures docs/soak.md records and leaves them, with the
# log, in bench/results/soak-*/.
#
#   bench/soak.sh [OPS] [POWER_CUTS] [DURATION] [go test -soak.* flags...]
#                 defaults: 10000000 ops, 1000 power cuts, no time limit
#
# DURATION (a Go duration, e.g. 25m) ends the run early; the report then
# gives the operations and power cuts actually done. The backing files live
# on tmpfs (/dev/shm, SOAK_DIR to change) so that the soak measures the
# server, not the disk; they are real files all the same (pread/pwrite,
# fdatasync, hole punching, SEEK_HOLE). Inject no panics with -soak.panics=false
# (a panic on a goroutine without a recover ends the process).
set -euo pipefail
cd "$(dirname "$0")/.."
ops=${1:-10000000}
cuts=${2:-1000}
duration=${3:-0}
shift 3 || shift $# || true

. bench/lib.sh
bench_setup soak go
dir=${SOAK_DIR:-/dev/shm}/soak.$$
mkdir -p "$dir"
trap 'rm -rf "$dir" "$work"' EXIT
go test -c -o "$work/soak.test" ./soak
echo "soak: $ops operations, $cuts power cuts, time limit $duration, files in $dir" | tee "$out/log.txt"
status=0
"$work/soak.test" -test.run '^TestSoak$' -test.v -test.timeout 0 \
	-soak.ops="$ops" -soak.crashes="$cuts" -soak.duration="$duration" \
	-soak.dir="$dir" -soak.report="$out/report.txt" "$@" >>"$out/log.txt" 2>&1 || status=$?
if [ -f "$out/report.txt" ]; then
	cat "$out/report.txt"
fi
if [ "$status" -ne 0 ]; then
	echo "soak failed (exit $status); the failures, or the panic that ended it:" >&2
	grep -v '^=== ' "$out/log.txt" | grep -A30 -m1 -E '^panic|soak_test.go:[0-9]+: [a-z]' >&2 || tail -40 "$out/log.txt" >&2
fi
echo "log and report: $out"
exit "$status"

#!/usr/bin/env bash
# The hostile load of issue 10 at full size: 64 connections per table, each
# keeping 64 of the most expensive requests in flight (maximum-length TRIM,
# BLOCK_STATUS, CACHE and WRITE_ZEROES) over a striped table with 1-sector
# chunks (4 GiB) and a table of 1,048,576 one-sector segments, while two
# more connections move a 1 GiB WRITE and a 1 GiB READ, against
# `nbdmapper serve --memory 64M`. It is cmd/nbdmapper's TestHostileLoad
# with bigger numbers: every request must get its reply, and the server's
# RSS may grow past its start-up size by at most the budget plus 64 MiB.
#
#   bench/hostile.sh [CONNS [DEPTH]]     defaults: 64, 64
#
# Prints the test's figures (peak RSS, start-up RSS, budget) and the
# machine, and keeps the log in bench/results/hostile-*/. Needs 5 GiB of
# free space for sparse files (almost none of it is written).
set -euo pipefail
cd "$(dirname "$0")/.."
conns=${1:-64}
depth=${2:-64}
out=bench/results/hostile-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
{
	echo "machine: $(nproc) CPUs, $(awk '/MemTotal/ {print int($2/1024) " MiB"}' /proc/meminfo), $(uname -r), $(lscpu | sed -n 's/^Model name: *//p')"
	start=$(date +%s)
	HOSTILE_CONNS=$conns HOSTILE_DEPTH=$depth go test -count=1 -timeout 2h -run '^TestHostileLoad$' -v ./cmd/nbdmapper
	echo "wall: $(($(date +%s) - start)) s"
} 2>&1 | tee "$out/log.txt" | grep -E 'machine:|peak RSS|PASS|FAIL|wall:|ok '

#!/usr/bin/env bash
# The long run of the crash-point harness (package crash, docs/crash.md):
# every workload (linear, striped, snapshot racing, stacked) runs ROUNDS
# times with different seeds, and every crash point gets RANDOM random
# images besides the durable-only and all-writes ones. It fails unless at
# least MIN images were checked and none lost an acknowledged write.
#
#   [TAGS=nbdmapper_broken_flush] bench/crash.sh [ROUNDS] [RANDOM] [OPS] [MIN]
#   defaults: 5 rounds, 40 random images per point, 40 requests per client, 100000
#
# TAGS builds a deliberately broken server (docs/crash.md) to see the harness
# fail. The test's log is left in bench/results/crash-*/crash.log.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
random=${2:-40}
ops=${3:-40}
min=${4:-100000}
out=bench/results/crash-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
start=$(date +%s)
set +e
go test ${TAGS:+-tags "$TAGS"} -count=1 -timeout 120m -v -run '^TestCrashPoints$' ./crash \
	-crash.rounds="$rounds" -crash.random="$random" -crash.ops="$ops" -crash.min="$min" >"$out/crash.log" 2>&1
rc=$?
set -e
grep -E 'log entries|crash images checked|^(--- |ok|FAIL)' "$out/crash.log" | grep -v '^=== ' || true
echo "go test exit $rc after $(($(date +%s) - start)) s; log in $out/crash.log"
exit $rc

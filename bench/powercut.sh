#!/usr/bin/env bash
# The long run of the guest power-cut test (vmtest.TestPowerCut,
# docs/crash.md): CUTS SIGKILLs of QEMU while the guest writes raw records
# and fsync'd ext4 files through nbdmapper and /dev/nbd0, each followed by a
# boot on the same disk image that checks every acknowledged record and
# file and runs e2fsck (CUTS+1 boots, about 40 s each under TCG).
#
#   [TAGS=nbdmapper_broken_flush] bench/powercut.sh [CUTS]     default 50
#
# TAGS builds a deliberately broken nbdmapper for the guest (docs/crash.md)
# to see the test fail. The test's log is left in
# bench/results/powercut-*/powercut.log.
set -euo pipefail
cd "$(dirname "$0")/.."
cuts=${1:-50}
out=bench/results/powercut-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
if [ -n "${TAGS:-}" ]; then
	CGO_ENABLED=0 go build -tags "$TAGS" -o "$out/nbdmapper" ./cmd/nbdmapper
	export NBDMAPPER_BIN=$PWD/$out/nbdmapper
fi
start=$(date +%s)
set +e
go test -count=1 -timeout 600m -v -run '^TestPowerCut$' ./vmtest -powercut.cuts="$cuts" >"$out/powercut.log" 2>&1
rc=$?
set -e
grep -E 'powercut_test.go|^(--- |ok|FAIL)' "$out/powercut.log" | grep -v '^=== ' || true
echo "go test exit $rc after $(($(date +%s) - start)) s; log in $out/powercut.log"
exit $rc

#!/usr/bin/env bash
# Regenerates the kernel-made COW fixtures in this directory by running
# the Linux kernel's dm-snapshot in a vmtest guest (slow: boots a kernel
# under TCG). Run from anywhere:
#
#   snapshot/testdata/kernel/make.sh
#
# It writes the nbdmapper-made inputs with `go test -run TestKernelInputs`,
# runs guest.sh in the guest, and keeps the guest's outputs, gzipped, next
# to this script; TestKernelCOW reads them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
out=$(mktemp -d /tmp/snapkernel.XXXXXX)
# origin-initial.img: 2 MiB; each 4 KiB chunk is 256 lines "orig chunk NNNN",
# so every chunk differs and the fixtures compress well.
awk 'BEGIN { for (c = 0; c < 512; c++) for (l = 0; l < 256; l++) printf "orig chunk %04d\n", c }' >"$out/origin-initial.img"
(cd "$repo" && go test ./snapshot/ -run TestKernelInputs -kernel-inputs "$out")
"$repo/internal/testing/vmtest/run.sh" -o "$out" -d 16 "$here/guest.sh"
for f in k-cow.img k-origin.img k-view.img n-kview.img n-cow-after.img; do
	gzip -9 -n -c "$out/$f" >"$here/$f.gz"
done
cp "$out"/k-status.txt "$out"/k-table.txt "$out"/n-kstatus.txt "$out"/n-ktable.txt "$out"/n-kstatus-after.txt "$here/"
gzip -9 -n -c "$out/n-origin.img" >"$here/n-origin.img.gz"
gzip -9 -n -c "$out/n-view.img" >"$here/n-view.img.gz"
echo "fixtures in $here (scratch: $out)"

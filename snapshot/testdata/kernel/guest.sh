#!/usr/bin/env bash
# Runs in the vmtest guest (see make.sh): the kernel's dm-snapshot on the
# scratch disk /dev/vda, both ways.
#
# 1. kernel -> nbdmapper: a new P store (chunk 8) written by dm-snapshot:
#    a partial and a whole-chunk snapshot write, then 300 chunks written
#    through snapshot-origin (so area 0, 256 entries, fills and area 1
#    starts). Saves k-cow.img, k-origin.img (origin after the writes),
#    k-view.img (what the kernel's snapshot reads), k-status.txt, k-table.txt.
# 2. nbdmapper -> kernel: activates n-cow.img (written by nbdmapper) over
#    n-origin.img, saves what the kernel reads (n-kview.img) and its status,
#    writes one more chunk through the kernel and saves the COW again
#    (n-cow-after.img) for nbdmapper to read back.
#
# Disk layout in sectors: k origin 0+4096, k cow 4096+6144,
# n origin 10240+4096, n cow 14336+6144.
set -euo pipefail
cd "$VMOUT"
d=${VMTEST_DISK:-/dev/vda}

put() { dd if="$1" of="$2" bs=64k oflag=direct status=none; }
get() { dd if="$1" of="$2" bs=64k iflag=direct status=none; }
fill() { head -c "$2" /dev/zero | tr '\0' "$1"; }
# mk NAME TABLE: dmsetup create; the guest has no udev to make the node.
mk() {
	dmsetup create "$1" --table "$2"
	[ -b "/dev/mapper/$1" ] || dmsetup mknodes "$1"
}

mk korigin "0 4096 linear $d 0"
mk kcow "0 6144 linear $d 4096"
put origin-initial.img /dev/mapper/korigin
dd if=/dev/zero of=/dev/mapper/kcow bs=64k count=1 oflag=direct status=none
mk ksnap "0 4096 snapshot /dev/mapper/korigin /dev/mapper/kcow P 8"
mk korig "0 4096 snapshot-origin /dev/mapper/korigin"
printf 'kernel snapshot write' | dd of=/dev/mapper/ksnap bs=1 seek=5000 conv=notrunc,fsync status=none
fill S 4096 | dd of=/dev/mapper/ksnap bs=4096 seek=10 oflag=direct status=none
fill O $((300 * 4096)) | dd of=/dev/mapper/korig bs=4096 seek=100 oflag=direct status=none
sync
dmsetup status ksnap >k-status.txt
dmsetup table ksnap >k-table.txt
get /dev/mapper/ksnap k-view.img
dmsetup remove korig
dmsetup remove ksnap
get /dev/mapper/korigin k-origin.img
get /dev/mapper/kcow k-cow.img
echo "kernel-made store: $(cat k-status.txt)"

mk norigin "0 4096 linear $d 10240"
mk ncow "0 6144 linear $d 14336"
put n-origin.img /dev/mapper/norigin
put n-cow.img /dev/mapper/ncow
mk nsnap "0 4096 snapshot /dev/mapper/norigin /dev/mapper/ncow P 8"
dmsetup status nsnap >n-kstatus.txt
dmsetup table nsnap >n-ktable.txt
get /dev/mapper/nsnap n-kview.img
fill K 4096 | dd of=/dev/mapper/nsnap bs=4096 seek=20 oflag=direct status=none
sync
dmsetup status nsnap >n-kstatus-after.txt
dmsetup remove nsnap
get /dev/mapper/ncow n-cow-after.img
echo "nbdmapper-made store as the kernel sees it: $(cat n-kstatus.txt)"
if cmp -s n-view.img n-kview.img; then echo "n-view: kernel reads what nbdmapper wrote"; else echo "n-view: DIFFERENT"; exit 1; fi

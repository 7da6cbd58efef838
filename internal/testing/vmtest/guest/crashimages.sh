# The kernel's dm-snapshot reads crash images (crash.TestKernelReadsCrashImages):
# $VMOUT/crashimg/NNN/ holds origin.img and cow.img of one crash image of
# the crash package's snapshot workload, and expect: the sha256 of the
# snapshot as nbdmapper read it, nbdmapper's status line for it, and the
# chunk size. Each pair is served by nbdmapper as two linear exports,
# attached as /dev/nbd0 and /dev/nbd1, and loaded read-only as a kernel
# snapshot of /dev/nbd0 with /dev/nbd1 as its COW: its status and its
# bytes must be nbdmapper's.
#	crashimg NNN ok|FAIL <detail>
#	VMTEST-RESULT kernel_crash_images PASS|FAIL <detail>
set -uo pipefail
here=$(dirname "$(realpath "$0")")
. "$here/lib.sh"

n=0 bad=0
for d in "$VMOUT"/crashimg/*/; do
	id=$(basename "$d")
	cp "$d/origin.img" /tmp/o.img && cp "$d/cow.img" /tmp/c.img || exit 1
	osz=$(($(stat -c %s /tmp/o.img) / 512))
	csz=$(($(stat -c %s /tmp/c.img) / 512))
	echo "0 $osz linear /tmp/o.img 0" >/tmp/o.table
	echo "0 $csz linear /tmp/c.img 0" >/tmp/c.table
	ok=1
	serve_set --metrics=off o=/tmp/o.table c=/tmp/c.table &&
		attach_export o /dev/nbd0 --block-size 512 &&
		attach_export c /dev/nbd1 --block-size 512 || ok=0
	want_sha=$(sed -n 1p "$d/expect")
	want_status=$(sed -n 2p "$d/expect")
	chunk=$(sed -n 3p "$d/expect")
	got_status="" got_sha=""
	if [ $ok = 1 ] && dmsetup create --readonly kcrash --table "0 $osz snapshot /dev/nbd0 /dev/nbd1 P $chunk" 2>/tmp/dm.log &&
		dmsetup mknodes kcrash; then
		got_status=$(dmsetup status kcrash)
		got_sha=$(sha256sum </dev/mapper/kcrash | cut -d' ' -f1)
		dmsetup remove kcrash
	else
		tail -5 /tmp/dm.log 2>/dev/null
	fi
	"$NBDMAPPER" detach /dev/nbd1 >/dev/null 2>&1
	"$NBDMAPPER" detach /dev/nbd0 >/dev/null 2>&1
	unserve
	wait # for the attach processes
	n=$((n + 1))
	if [ "$got_status" = "$want_status" ] && [ "$got_sha" = "$want_sha" ]; then
		echo "crashimg $id ok: $got_status"
	else
		bad=$((bad + 1))
		echo "crashimg $id FAIL: kernel status '$got_status' sha256 $got_sha; nbdmapper '$want_status' $want_sha"
	fi
done
echo "VMTEST-METRIC kernel_crash_images=$n"
if [ $n -gt 0 ] && [ $bad = 0 ]; then
	echo "VMTEST-RESULT kernel_crash_images PASS $n crash images: same status and bytes"
else
	echo "VMTEST-RESULT kernel_crash_images FAIL $bad of $n crash images differ"
	exit 1
fi

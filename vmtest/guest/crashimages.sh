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
	rm -f "$sock"
	"$NBDMAPPER" serve --socket "$sock" --metrics=off o=/tmp/o.table c=/tmp/c.table >>/tmp/serve.log 2>&1 &
	serve_pid=$!
	for ((i = 0; i < 300; i++)); do
		[ -S "$sock" ] && break
		sleep 0.1
	done
	ok=1
	for x in o:nbd0 c:nbd1; do
		"$NBDMAPPER" attach --socket "$sock" --export "${x%%:*}" --block-size 512 "/dev/${x#*:}" >>/tmp/attach.log 2>&1 &
		for ((i = 0; i < 300; i++)); do
			[ -e "/sys/block/${x#*:}/pid" ] && break
			sleep 0.1
		done
		[ -e "/sys/block/${x#*:}/pid" ] || ok=0
	done
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
		cat /tmp/attach.log /tmp/dm.log 2>/dev/null | tail -5
	fi
	"$NBDMAPPER" detach /dev/nbd1 >/dev/null 2>&1
	"$NBDMAPPER" detach /dev/nbd0 >/dev/null 2>&1
	kill -TERM "$serve_pid" 2>/dev/null
	wait 2>/dev/null
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
